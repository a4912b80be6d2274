//! Content digests: SHA-256 in lower-case hexadecimal, the one checksum every file pipewright
//! writes or checks carries (checkpoint parts and manifests, tokenizer files, corpora), so a
//! reader can tell a damaged or substituted file from the one that was written.

use sha2::{Digest, Sha256};

/// Lower-case hexadecimal.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_is_the_standard_digest() {
        // FIPS 180-2's example "abc".
        assert_eq!(
            sha256(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&[0, 15, 255]), "000fff");
    }
}
