//! A user's own corpus: a [`Tokenizer`] (trained here as a byte-level BPE, or any
//! `tokenizer.json`), the corpus encoded once into token shards ([`prepare`]: fixed-size files
//! of u16 or u32 ids and a JSON index, as nanoGPT's `.bin` and Megatron's indexed datasets), and
//! a [`TokenDataset`] that memory-maps them and yields training windows: the same rows for the
//! same step whatever the layout, a new order every epoch, each replica its own rows.

pub mod blend;
pub mod corpus;
mod corpus_paths;
pub mod dataset;
pub mod documents;
mod encode;
pub mod shards;
pub mod tokenizer;

pub use blend::Blend;
pub use corpus::{Cleaned, InvalidUtf8};
pub use dataset::{Split, TokenDataset};
pub use documents::Corpus;
pub use encode::prepare;
pub use shards::{PrepareOptions, ShardIndex, TokenDtype};
pub use tokenizer::{Tokenizer, END_OF_TEXT};

/// Bytes of text in `corpus` ([`documents::text_bytes`]); an error when it holds none
/// (nothing to learn from).
fn corpus_bytes(corpus: &Corpus) -> crate::Result<u64> {
    let total = documents::text_bytes(corpus)?;
    if total == 0 {
        return Err(crate::invalid!(
            "the corpus is empty: its files hold no text"
        ));
    }
    Ok(total)
}
