//! A ResNet-style CNN: a stem, residual basic blocks (skip connections) with BatchNorm2d, and
//! a pooled linear head. Block `i` doubles the channels and halves the resolution whenever
//! `i` is a multiple of `blocks_per_stage` (except the first).

use candle_core::{Tensor, Var};
use pipewright::model::nn::{join, relu, BatchNorm2d, Conv2d, Init, Linear, Module};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::{Error, Result};
use serde::{Deserialize, Serialize};

/// The ResNet-style CNN's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CnnConfig {
    /// Channels of the input images.
    pub in_channels: usize,
    /// Classes of the read-out.
    pub classes: usize,
    /// Channels of the stem and the first blocks.
    pub width: usize,
    /// Number of residual blocks.
    pub blocks: usize,
    /// Blocks between down-samplings.
    pub blocks_per_stage: usize,
    /// A long skip connection: the stem stashes its output and the head pops it, adding a
    /// linear map of its pooled features to the logits (it crosses every stage between).
    pub long_skip: bool,
}

impl CnnConfig {
    /// The CNN a run gets when it names no size (`pipewright train --model cnn`): 16 channels
    /// wide, 4 residual blocks, two per stage of resolution, no long skip, for images of
    /// `in_channels` channels and `classes` classes.
    pub const fn small(in_channels: usize, classes: usize) -> Self {
        Self {
            in_channels,
            classes,
            width: 16,
            blocks: 4,
            blocks_per_stage: 2,
            long_skip: false,
        }
    }

    /// Fails on sizes the CNN cannot be built with.
    pub fn validate(&self) -> Result<()> {
        pipewright::Error::require_positive(
            "CNN",
            &[
                ("in_channels", self.in_channels),
                ("classes", self.classes),
                ("width", self.width),
                ("blocks", self.blocks),
                ("blocks_per_stage", self.blocks_per_stage),
            ],
        )
    }

    fn channels(&self, block: usize) -> usize {
        self.width << (block / self.blocks_per_stage)
    }
}

/// `stem`, `blocks.0` .. `blocks.{n-1}`, `head`; a cut point after every layer.
pub fn cnn(cfg: CnnConfig) -> Result<Sequential> {
    cfg.validate()?;
    let mut s = Sequential::new();
    let stem = LayerSpec::new("stem", move |init| {
        let conv = Conv2d::new(
            init,
            "stem.conv",
            cfg.in_channels,
            cfg.width,
            3,
            1,
            1,
            false,
        )?;
        Ok(Box::new(Stem {
            conv,
            bn: BatchNorm2d::new(init, "stem.bn", cfg.width)?,
            long_skip: cfg.long_skip,
        }) as Box<dyn Layer>)
    });
    s.push(if cfg.long_skip {
        stem.stashes(&[SKIP])
    } else {
        stem
    })
    .cut();
    for i in 0..cfg.blocks {
        let name = format!("blocks.{i}");
        let inp = if i == 0 {
            cfg.width
        } else {
            cfg.channels(i - 1)
        };
        let out = cfg.channels(i);
        let stride = if out != inp { 2 } else { 1 };
        s.push(LayerSpec::new(name.clone(), move |init| {
            Ok(Box::new(BasicBlock::new(init, &name, inp, out, stride)?) as Box<dyn Layer>)
        }))
        .cut();
    }
    let last = cfg.channels(cfg.blocks - 1);
    let head = LayerSpec::new("head", move |init| {
        let skip = if cfg.long_skip {
            Some(Linear::new(
                init,
                "head.skip",
                cfg.width,
                cfg.classes,
                false,
            )?)
        } else {
            None
        };
        Ok(Box::new(Head {
            fc: Linear::new(init, "head.fc", last, cfg.classes, true)?,
            skip,
        }) as Box<dyn Layer>)
    });
    s.push(if cfg.long_skip {
        head.pops(&[SKIP])
    } else {
        head
    });
    Ok(s)
}

/// Name of the long skip connection.
pub const SKIP: &str = "stem_to_head";

struct Stem {
    conv: Conv2d,
    bn: BatchNorm2d,
    long_skip: bool,
}

impl Layer for Stem {
    fn name(&self) -> &str {
        "stem"
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor("stem")?;
        let y = relu(&self.bn.forward(&self.conv.forward_cx(&x, cx)?, cx)?)?;
        if self.long_skip {
            cx.stash("stem", SKIP, y.clone())?;
        }
        Ok(y.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.conv.params();
        v.extend(self.bn.params());
        v
    }

    fn buffers(&self) -> Vec<(String, Var)> {
        self.bn.buffers()
    }

    fn finish_batch(&self) -> Result<()> {
        self.bn.finish_batch()
    }
}

/// `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`; the shortcut is a strided 1x1
/// convolution with BatchNorm when the shape changes, the identity otherwise.
pub struct BasicBlock {
    name: String,
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    shortcut: Option<(Conv2d, BatchNorm2d)>,
}

impl BasicBlock {
    /// A block `name` from `inp` to `out` channels at `stride` (a 1x1 shortcut where the shape
    /// changes).
    pub fn new(init: &Init, name: &str, inp: usize, out: usize, stride: usize) -> Result<Self> {
        let shortcut = if stride != 1 || inp != out {
            Some((
                Conv2d::new(
                    init,
                    &join(name, "shortcut.conv"),
                    inp,
                    out,
                    1,
                    stride,
                    0,
                    false,
                )?,
                BatchNorm2d::new(init, &join(name, "shortcut.bn"), out)?,
            ))
        } else {
            None
        };
        Ok(Self {
            name: name.to_string(),
            conv1: Conv2d::new(init, &join(name, "conv1"), inp, out, 3, stride, 1, false)?,
            bn1: BatchNorm2d::new(init, &join(name, "bn1"), out)?,
            conv2: Conv2d::new(init, &join(name, "conv2"), out, out, 3, 1, 1, false)?,
            bn2: BatchNorm2d::new(init, &join(name, "bn2"), out)?,
            shortcut,
        })
    }
}

impl Layer for BasicBlock {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor(&self.name)?;
        let h = relu(&self.bn1.forward(&self.conv1.forward_cx(&x, cx)?, cx)?)?;
        let h = self.bn2.forward(&self.conv2.forward_cx(&h, cx)?, cx)?;
        let s = match &self.shortcut {
            Some((c, b)) => b.forward(&c.forward_cx(&x, cx)?, cx)?,
            None => x,
        };
        Ok(relu(&(h + s)?)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.conv1.params();
        v.extend(self.bn1.params());
        v.extend(self.conv2.params());
        v.extend(self.bn2.params());
        if let Some((c, b)) = &self.shortcut {
            v.extend(c.params());
            v.extend(b.params());
        }
        v
    }

    fn buffers(&self) -> Vec<(String, Var)> {
        let mut v = self.bn1.buffers();
        v.extend(self.bn2.buffers());
        if let Some((_, b)) = &self.shortcut {
            v.extend(b.buffers());
        }
        v
    }

    fn finish_batch(&self) -> Result<()> {
        self.bn1.finish_batch()?;
        self.bn2.finish_batch()?;
        if let Some((_, b)) = &self.shortcut {
            b.finish_batch()?;
        }
        Ok(())
    }
}

/// Global average pooling, then a linear classifier: `(batch, classes)`; plus a linear map of
/// the pooled stem features when the long skip is on.
struct Head {
    fc: Linear,
    skip: Option<Linear>,
}

impl Layer for Head {
    fn name(&self) -> &str {
        "head"
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let x: Tensor = x.into_tensor("head")?;
        if x.rank() != 4 {
            return Err(Error::Layer {
                layer: "head".into(),
                msg: format!("expects (batch, channels, h, w), got {:?}", x.dims()),
            });
        }
        let mut logits = self.fc.forward_cx(&x.mean(3)?.mean(2)?, cx)?;
        if let Some(skip) = &self.skip {
            let stem = cx.pop("head", SKIP)?;
            logits = (logits + skip.forward_cx(&stem.mean(3)?.mean(2)?, cx)?)?;
        }
        Ok(logits.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.fc.params();
        if let Some(s) = &self.skip {
            v.extend(s.params());
        }
        v
    }
}
