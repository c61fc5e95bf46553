//! Times one op shape through kandle's public layer API: the layer is built from its recipe with
//! a `BuildContext` and run with candle's autograd, exactly as inside the network, so whatever
//! kernels the layers use are what is measured.
//!
//! Each figure is the fastest of the timed runs. Passes are separated by what autograd is
//! asked for. The forward pass runs on inputs that are
//! not variables; forward and backward run with the inputs as variables (the layer's own
//! parameters always are), the upstream gradient being all ones. The backward pass is the
//! difference. For a convolution, a third run keeps the input a constant: its backward is the
//! weight gradient alone when the layer skips the gradient of an input that does not need one,
//! which splits the backward into its input and weight parts. When the layer computes the input
//! gradient regardless, as candle's own convolution does, the split is timed instead with the
//! two candle ops that candle's backward runs (`conv_transpose2d` for the input, a transposed
//! `conv2d` for the weight), and marked as such. kandle's cuDNN convolution computes both
//! gradients in one backward and its two gradient operations are not public, so on that path
//! the backward stays whole.
//!
//! On a CUDA device the layers are built there, so they run what kandle runs on that device
//! ([`KandlePath`]), and every timed run ends with the device synchronised: the times are the
//! GPU's, cuDNN's algorithm search falling in the warm-up runs.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use kandle::layers::{
    AveragePooling2D, BatchNormalization, BuildContext, CandleLayer, Concat, Conv2D,
    GlobalAveragePooling2D, Layer, LayerSpec, MaxPooling2D, Padding,
};
use kandle::params::ParamStore;

use crate::inventory::{OpKind, OpShape};
use crate::passes::{Passes, Split, SplitSource};
use crate::timing::Timer;

/// What kandle runs for the timed ops on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KandlePath {
    /// kandle's CPU kernels.
    CpuKernels,
    /// kandle's CUDA kernels for batch norm and pooling, cuDNN for convolutions (a build with
    /// the `cudnn` feature).
    CudaKernelsCudnn,
    /// kandle's CUDA kernels for batch norm and pooling, candle's `conv2d` for convolutions.
    CudaKernelsCandleConv,
}

impl KandlePath {
    /// The path this build takes on `device`.
    pub fn on(device: &Device) -> Self {
        if device.is_cpu() {
            KandlePath::CpuKernels
        } else if cfg!(feature = "cudnn") {
            KandlePath::CudaKernelsCudnn
        } else {
            KandlePath::CudaKernelsCandleConv
        }
    }

    /// A short name, for the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            KandlePath::CpuKernels => "cpu-kernels",
            KandlePath::CudaKernelsCudnn => "cuda-kernels+cudnn",
            KandlePath::CudaKernelsCandleConv => "cuda-kernels+candle-conv",
        }
    }

    /// What runs, in words.
    pub fn describe(self) -> &'static str {
        match self {
            KandlePath::CpuKernels => "kandle's CPU kernels",
            KandlePath::CudaKernelsCudnn => {
                "kandle's CUDA kernels for batch norm and pooling, cuDNN (kandle's op, \
                 algorithms searched per shape) for convolutions, candle's ops for concatenation"
            }
            KandlePath::CudaKernelsCandleConv => {
                "kandle's CUDA kernels for batch norm and pooling, candle's conv2d for \
                 convolutions (a build without the cudnn feature), candle's ops for concatenation"
            }
        }
    }
}

/// Times ops on one device: warm-up runs, then timed runs, each ended by synchronising the
/// device (a no-op on the CPU).
#[derive(Clone, Copy)]
pub struct OpTimer<'a> {
    /// Where the ops run.
    pub device: &'a Device,
    /// Warm-up and timed runs.
    pub timer: Timer,
}

impl OpTimer<'_> {
    /// The fastest run of `f`, the device's queued work included.
    fn fastest<F: FnMut() -> Result<()>>(&self, mut f: F) -> Result<f64> {
        self.device.synchronize()?;
        self.timer.fastest(|| {
            f()?;
            Ok(self.device.synchronize()?)
        })
    }
}

/// Times `op` at `batch`.
pub fn time_op(op: &OpShape, batch: usize, on: OpTimer<'_>) -> Result<Passes> {
    let device = on.device;
    if let OpKind::Concat { parts } = &op.kind {
        let parts: Vec<[usize; 4]> = parts
            .iter()
            .map(|&c| [batch, c, op.input[1], op.input[2]])
            .collect();
        let unused = Tensor::zeros(1, DType::F32, device)?;
        let fwd = forward_time(concat_of(&parts, false, device)?.as_ref(), &unused, on)?;
        let both = backward_time(concat_of(&parts, true, device)?.as_ref(), &unused, on)?;
        return Ok(Passes {
            fwd,
            bwd: both - fwd,
            split: None,
        });
    }
    let (layer, store) = build(spec_of(&op.kind)?, &op.input, device)?;
    let dims = vec![batch, op.input[0], op.input[1], op.input[2]];
    let x = Tensor::randn(0f32, 1., dims, device)?;
    let tracked = Var::from_tensor(&x)?;
    let fwd = forward_time(layer.as_ref(), &x, on)?;
    let both = backward_time(layer.as_ref(), tracked.as_tensor(), on)?;
    let split = match op.kind {
        OpKind::Conv { .. } if KandlePath::on(device) != KandlePath::CudaKernelsCudnn => {
            Some(conv_split(op, layer.as_ref(), &store, &x, on, fwd, both)?)
        }
        _ => None,
    };
    Ok(Passes {
        fwd,
        bwd: both - fwd,
        split,
    })
}

/// The layer recipe for an op with one input.
fn spec_of(kind: &OpKind) -> Result<Box<dyn LayerSpec>> {
    Ok(match *kind {
        OpKind::Conv {
            filters,
            kernel,
            stride,
            padding,
            bias,
        } => Box::new(
            Conv2D::new(filters, kernel)
                .stride(stride)
                .padding(padding)
                .use_bias(bias),
        ),
        OpKind::BatchNorm => Box::new(BatchNormalization::new()),
        OpKind::MaxPool {
            window,
            stride,
            pad,
        } => Box::new(
            MaxPooling2D::new(window)
                .stride(stride)
                .padding(Padding::symmetric(pad, pad)),
        ),
        OpKind::AvgPool { window } => Box::new(AveragePooling2D::new(window)),
        OpKind::GlobalAvgPool => Box::new(GlobalAveragePooling2D),
        OpKind::Concat { .. } => bail!("a concatenation is built from its parts"),
    })
}

fn build(
    spec: Box<dyn LayerSpec>,
    input: &[usize],
    device: &Device,
) -> Result<(Box<dyn Layer>, ParamStore)> {
    let mut ctx = BuildContext::new(device, 0);
    let built = spec.build(&mut ctx, input)?;
    Ok((built.into_layer(), ctx.into_store()))
}

/// A `Concat` layer whose branches return fixed tensors of the given shapes (variables when
/// `tracked`), so that running it times the concatenation and its backward alone.
fn concat_of(parts: &[[usize; 4]], tracked: bool, device: &Device) -> Result<Box<dyn Layer>> {
    let branches = parts
        .iter()
        .map(|dims| {
            let value = Tensor::randn(0f32, 1., dims.to_vec(), device)?;
            let value = if tracked {
                Var::from_tensor(&value)?.as_tensor().clone()
            } else {
                value
            };
            Ok(CandleLayer::new(move |_vb| {
                let value = value.clone();
                Ok(move |_x: &Tensor| Ok(value.clone()))
            }))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(build(Box::new(Concat::new(branches)), &[1, 1, 1], device)?.0)
}

fn forward_time(layer: &dyn Layer, x: &Tensor, on: OpTimer<'_>) -> Result<f64> {
    on.fastest(|| {
        std::hint::black_box(layer.forward_t(x, true)?);
        Ok(())
    })
}

fn backward_time(layer: &dyn Layer, x: &Tensor, on: OpTimer<'_>) -> Result<f64> {
    on.fastest(|| {
        std::hint::black_box(layer.forward_t(x, true)?.backward()?);
        Ok(())
    })
}

/// Splits a convolution's backward (`fwd`: forward alone, `both`: forward and backward with
/// the input a variable). Runs forward and backward with a constant input: when that leaves the
/// input without a gradient, it timed the weight gradient alone; otherwise the split is timed
/// with candle's backward ops.
fn conv_split(
    op: &OpShape,
    layer: &dyn Layer,
    store: &ParamStore,
    x: &Tensor,
    on: OpTimer<'_>,
    fwd: f64,
    both: f64,
) -> Result<Split> {
    if layer.forward_t(x, true)?.backward()?.get(x).is_none() {
        let weight_run = backward_time(layer, x, on)?;
        return Ok(Split {
            input: both - weight_run,
            weight: weight_run - fwd,
            source: SplitSource::Toggled,
        });
    }
    let OpKind::Conv { kernel, stride, .. } = op.kind else {
        bail!("not a convolution: {:?}", op.kind);
    };
    let [pad, ..] = op.pads();
    let weight = store
        .get("weight")
        .context("the convolution has no `weight`")?
        .var
        .as_tensor()
        .detach();
    let [f, oh, ow] = op.output;
    let grad = Tensor::ones((x.dim(0)?, f, oh, ow), DType::F32, x.device())?;
    // As candle's backward for `conv2d` computes the two gradients.
    let out_padding = op.input[1] + 2 * pad - ((oh - 1) * stride + kernel);
    let input = on.fastest(|| {
        std::hint::black_box(grad.conv_transpose2d(&weight, pad, out_padding, stride, 1)?);
        Ok(())
    })?;
    let weight = on.fastest(|| {
        let g = x
            .transpose(0, 1)?
            .conv2d(&grad.transpose(0, 1)?, pad, 1, stride, 1)?
            .transpose(0, 1)?;
        std::hint::black_box(g.narrow(2, 0, kernel)?.narrow(3, 0, kernel)?);
        Ok(())
    })?;
    Ok(Split {
        input,
        weight,
        source: SplitSource::CandleOps,
    })
}
