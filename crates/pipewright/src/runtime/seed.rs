//! Seeds derived from names: the one hash every seeded stream starts from (parameter
//! initialisation, dropout masks, the local backend's group ids, tokenizer-independent task
//! data), so that a value never depends on which rank or thread draws it.

/// 64-bit FNV-1a over a sequence of byte strings, used to derive seeds from names.
pub fn hash_seed(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.iter().chain(std::iter::once(&0xffu8)) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
