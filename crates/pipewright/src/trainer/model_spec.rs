//! What a model says about itself: one trait every model implements (the reference GPT,
//! Llama and CNN, and a user's), so that the trainer, the planner, the memory check and
//! morphing serve every model alike instead of each knowing each model.
//!
//! - [`ModelSpec::build`]: the [`Sequential`] to train, and [`ModelSpec::tied`] the parameter
//!   pairs kept equal.
//! - [`ModelSpec::tp_divides`]: the parallel rules (a tensor-parallel size must divide each).
//! - [`ModelSpec::shapes`]: the layers by shape, which the planner costs on a hardware file
//!   ([`ModelShapes::profile`]); a model without them is profiled by running it
//!   ([`crate::plan::measure()`]).
//! - [`ModelSpec::hf_names`]: its checkpoint names, what a Hugging Face file calls each
//!   parameter (pretrained weights in).
//!
//! A user's model needs no more than [`Custom`]: its [`Sequential`] and, optionally, its
//! shapes and tensor-parallel rules.

use crate::model::precision::Precision;
use crate::model::Sequential;
use crate::plan::{Hardware, ModelShapes, Profile};
use crate::Result;

/// A model that describes itself to the trainer and the planner.
pub trait ModelSpec {
    /// What it is, for messages ("this Llama (1.2 B parameters)").
    fn what(&self) -> String;

    /// The model to train, its parameters named as its checkpoints name them.
    fn build(&self) -> Result<Sequential>;

    /// Parameter pairs kept equal (tied weights: a GPT's head and embedding).
    fn tied(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Sizes a tensor-parallel size must divide (heads, vocabulary, ...); `[1]`: the model
    /// does not split over tensor-parallel ranks.
    fn tp_divides(&self) -> Vec<usize> {
        vec![1]
    }

    /// The model by its shapes for a sample of `sample` dims (`[seq]` of tokens, `[channels,
    /// height, width]` of an image): what the planner sizes it from without running it. None:
    /// it must be profiled by running it.
    fn shapes(&self, sample: &[usize]) -> Result<Option<ModelShapes>> {
        let _ = sample;
        Ok(None)
    }

    /// The planner's profile of the model from its shapes for samples of `sample` dims,
    /// computing in `precision` on `hw`; none for a model without shapes.
    fn shapes_profile(
        &self,
        sample: &[usize],
        precision: Precision,
        hw: &Hardware,
    ) -> Result<Option<Profile>> {
        self.shapes(sample)?
            .map(|s| s.profile(hw, precision.dtype().size_in_bytes()))
            .transpose()
    }

    /// The names parameter `name` may have in a Hugging Face file, preferred first (a head
    /// tied to the embedding is often left out of the file and found under the embedding's
    /// name). By default its own name.
    fn hf_names(&self, name: &str) -> Vec<String> {
        vec![name.to_string()]
    }
}

/// A user's model: its [`Sequential`], what it is called, and optionally its tied pairs, its
/// tensor-parallel rules and its shapes.
#[derive(Clone, Debug)]
pub struct Custom {
    /// The model.
    pub model: Sequential,
    /// Its name in messages.
    pub name: String,
    /// Parameter pairs kept equal.
    pub tied: Vec<(String, String)>,
    /// Sizes a tensor-parallel size must divide (`[1]`: no tensor parallelism).
    pub tp_divides: Vec<usize>,
    /// Its shapes, when known (the planner then sizes it without running it).
    pub shapes: Option<ModelShapes>,
}

impl Custom {
    /// `model` named `name`, untied, without tensor parallelism or shapes.
    pub fn new(name: impl Into<String>, model: Sequential) -> Self {
        Self {
            model,
            name: name.into(),
            tied: Vec::new(),
            tp_divides: vec![1],
            shapes: None,
        }
    }
}

impl ModelSpec for Custom {
    fn what(&self) -> String {
        self.name.clone()
    }

    fn build(&self) -> Result<Sequential> {
        Ok(self.model.clone())
    }

    fn tied(&self) -> Vec<(String, String)> {
        self.tied.clone()
    }

    fn tp_divides(&self) -> Vec<usize> {
        self.tp_divides.clone()
    }

    fn shapes(&self, _sample: &[usize]) -> Result<Option<ModelShapes>> {
        Ok(self.shapes.clone())
    }
}
