//! Seeds derived from names: the one hash every seeded stream starts from (parameter
//! initialisation, dropout masks, the local backend's group ids, tokenizer-independent task
//! data), so that a value never depends on which rank or thread draws it; and the random
//! streams those seeds start ([`rng_for`]) with the normal samples drawn from them.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// A seeded random stream for `(seed, key)`.
pub fn rng_for(seed: u64, key: &str) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(hash_seed(&[&seed.to_le_bytes(), key.as_bytes()]))
}

/// Standard normal samples by Box-Muller (no extra dependency, identical on every platform).
pub fn normal_vec(rng: &mut impl Rng, n: usize, mean: f64, std: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push(mean + std * r * t.cos());
        out.push(mean + std * r * t.sin());
    }
    out.truncate(n);
    out
}
