//! Pipeline parallelism. Today: micro-batches (used by gradient accumulation in the serial
//! trainer, so that later layouts compare with it flag for flag).

pub mod microbatch;
