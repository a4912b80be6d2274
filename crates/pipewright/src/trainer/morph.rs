//! A run restarted in a world of another size, for any model that describes itself: the one
//! morph of the trainer ([`TrainSpec::morph_model`]), over the spec's layout-only
//! [`TrainSpec::morph`].

use crate::engine::spec::TrainSpec;
use crate::plan::{Cluster, Hardware, Morph, MorphPlanner};
use crate::trainer::model_spec::ModelSpec;
use crate::Result;

impl TrainSpec {
    /// This run restarted in a world of `world` ranks for `model` (Varuna's morphing, see
    /// [`TrainSpec::morph`]). With `machines` (the hardware and its ranks per node) and a model
    /// that gives its shapes for samples of `sample` dims, the planner costs every layout from
    /// them and the fastest that fits is taken; otherwise the layout nearest the old one.
    pub fn morph_model(
        &self,
        world: usize,
        model: &dyn ModelSpec,
        sample: &[usize],
        machines: Option<(&Hardware, usize)>,
    ) -> Result<(Self, Morph)> {
        let built = model.build()?;
        let profile = match machines {
            Some((hw, _)) => model.shapes_profile(sample, self.precision, hw)?,
            None => None,
        };
        let planner = match (machines, &profile) {
            (Some((hw, per_node)), Some(profile)) => Some(MorphPlanner {
                profile,
                cluster: Cluster {
                    hardware: hw,
                    ranks_per_node: per_node.clamp(1, world.max(1)),
                    runtime: Default::default(),
                },
                memory_bytes: hw.memory_bytes() as f64,
            }),
            _ => None,
        };
        self.morph(world, &built, model.tp_divides(), planner)
    }
}
