//! NaN propagation through every layer and fused pattern, on every compute path, as in PyTorch:
//! an input holding one NaN gives NaN outputs exactly where PyTorch's would be NaN (the NaN's
//! own position for element-wise layers, the windows that hold it for convolutions and pools,
//! its sample for a dense layer, its channel across the batch for a training BatchNorm),
//! finite outputs elsewhere, in training (`forward_t` and the recorded forward) and in
//! inference (folded or not); and the gradient reaches the NaN where PyTorch sends it. The
//! functional API's merges run the same checks ([`check_nans`]) in `functional/tests.rs`.

use candle_core::{Device, Tensor, Var};

use super::{
    Activation, Add, AveragePooling2D, BatchNormalization, BuildContext, Concat, Conv2D, Dense,
    FastPath, GlobalAveragePooling2D, Identity, Layer, LayerSpecExt, MaxPooling2D, Padding,
    ParamGrads, RecordRequest, Sequential, SequentialNet,
};
use crate::{ComputePath, Result};

/// Whether output `o` (its index along each axis) must be NaN (`Some(true)`), must be finite
/// (`Some(false)`) or may be either (`None`), for an input NaN at `at`.
pub(crate) type Rule = fn(at: &[usize], o: &[usize]) -> Option<bool>;

/// One layer or fused pattern: its input shape (with the batch), the rules of its training and
/// inference outputs, and its input gradient at the NaN for an output gradient of ones, where
/// the test checks it.
pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) net: Sequential,
    pub(crate) input: &'static [usize],
    pub(crate) train: Rule,
    pub(crate) infer: Rule,
    pub(crate) grad_at_nan: Option<f32>,
}

/// Where the input's NaN is: the second sample, its second channel or feature, inside the
/// plane.
fn nan_at(dims: &[usize]) -> Vec<usize> {
    match dims.len() {
        4 => vec![1, 1, 3, 4],
        _ => vec![1, 5],
    }
}

/// A seeded input of `dims` with a NaN at [`nan_at`].
fn input_with_nan(dims: &[usize]) -> Result<Tensor> {
    let x = kandle_testing::random::seeded_uniform(dims, 7)?;
    let at = nan_at(dims);
    let flat = at.iter().zip(dims).fold(0, |i, (&a, &d)| i * d + a);
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    values[flat] = f32::NAN;
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
}

/// Asserts that `y`'s NaNs follow `rule` for the input NaN at `at`.
fn assert_nans(what: &str, y: &Tensor, at: &[usize], rule: Rule) -> Result<()> {
    let dims = y.dims().to_vec();
    let values = y.flatten_all()?.to_vec1::<f32>()?;
    let mut index = vec![0; dims.len()];
    for (i, v) in values.iter().enumerate() {
        let mut rest = i;
        for (axis, &d) in dims.iter().enumerate().rev() {
            index[axis] = rest % d;
            rest /= d;
        }
        if let Some(nan) = rule(at, &index) {
            assert_eq!(v.is_nan(), nan, "{what}: output {index:?} is {v}");
        }
    }
    Ok(())
}

/// The input gradient at the NaN, for an output gradient of ones.
fn grad_at(dx: &Tensor, at: &[usize]) -> Result<f32> {
    let mut g = dx.clone();
    for &i in at {
        g = g.get(i)?;
    }
    Ok(g.to_scalar::<f32>()?)
}

/// Runs `case` on every compute path with an input holding one NaN: inference first (a
/// training pass moves BatchNorm's statistics to NaN), then `forward_t` in training, the
/// recorded forward and its backward (on the path that records it), and candle's autograd.
pub(crate) fn check_nans(case: &Case) -> Result<()> {
    let x = input_with_nan(case.input)?;
    let at = nan_at(case.input);
    for path in [
        ComputePath::Auto,
        ComputePath::Autograd,
        ComputePath::DeviceGeneric,
    ] {
        let what = |mode: &str| format!("{}, {path}, {mode}", case.name);
        let ctx = BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
        let (net, _, _) = case.net.build_in(ctx, &case.input[1..])?;
        assert_nans(
            &what("inference"),
            &net.forward_t(&x, false)?,
            &at,
            case.infer,
        )?;
        assert_nans(
            &what("training"),
            &net.forward_t(&x, true)?,
            &at,
            case.train,
        )?;
        check_gradients(case, &net, &x, &at, path)?;
    }
    Ok(())
}

/// The recorded forward's output and input gradient (on [`ComputePath::Auto`], the path that
/// records), or candle's autograd's input gradient (on the others).
fn check_gradients(
    case: &Case,
    net: &SequentialNet,
    x: &Tensor,
    at: &[usize],
    path: ComputePath,
) -> Result<()> {
    let what = |mode: &str| format!("{}, {path}, {mode}", case.name);
    let dx = if path.records_backward(&Device::Cpu) {
        let run = net.forward_recorded(x, RecordRequest::output())?;
        assert_nans(&what("recorded"), &run.output, at, case.train)?;
        let dy = run.output.ones_like()?;
        run.backward
            .backward(dy, &mut ParamGrads::new(), true)?
            .ok_or_else(|| crate::Error::invalid("no input gradient"))?
    } else {
        let input = Var::from_tensor(x)?;
        let y = net.forward_t(input.as_tensor(), true)?;
        let grads = y.sum_all()?.backward()?;
        grads
            .get(input.as_tensor())
            .cloned()
            .ok_or_else(|| crate::Error::invalid("no autograd input gradient"))?
    };
    if let Some(want) = case.grad_at_nan {
        assert_eq!(grad_at(&dx, at)?, want, "{}", what("gradient at the NaN"));
    }
    Ok(())
}

/// The NaN's own position.
pub(crate) fn same(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o == at)
}

/// Every channel of the NaN's sample within one row and column of it (a 3x3 `same`
/// convolution's outputs that read it), and nothing else.
fn near(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[0] == at[0] && o[2].abs_diff(at[2]) <= 1 && o[3].abs_diff(at[3]) <= 1)
}

/// At least [`near`], and nothing outside the NaN's sample: Winograd's F(4x4, 3x3) spreads a
/// NaN over the 4x4 output tiles whose input tiles hold it.
fn at_least_near(at: &[usize], o: &[usize]) -> Option<bool> {
    match (near(at, o), o[0] == at[0]) {
        (Some(true), _) => Some(true),
        (_, true) => None,
        (_, false) => Some(false),
    }
}

/// Every output of the NaN's sample.
fn sample(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[0] == at[0])
}

/// Every output of the NaN's channel, across the batch (training BatchNorm's statistics).
fn channel(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[1] == at[1])
}

/// Every output: a training BatchNorm after a convolution that put a NaN in every channel.
fn all(_: &[usize], _: &[usize]) -> Option<bool> {
    Some(true)
}

/// The output of a 2x2 window at stride 2 that holds the NaN.
fn window_2(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[..2] == at[..2] && o[2] == at[2] / 2 && o[3] == at[3] / 2)
}

/// The outputs of 3x3 windows at stride 2 (padded after the plane) that hold the NaN.
fn window_3_2(at: &[usize], o: &[usize]) -> Option<bool> {
    let holds = |o: usize, a: usize| (2 * o..=2 * o + 2).contains(&a);
    Some(o[..2] == at[..2] && holds(o[2], at[2]) && holds(o[3], at[3]))
}

/// The NaN's plane's mean.
fn plane(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[..2] == at[..2])
}

/// A concatenation of the input (4 channels) and its ReLU: the NaN in both halves.
pub(crate) fn both_halves(at: &[usize], o: &[usize]) -> Option<bool> {
    Some(o[0] == at[0] && o[1] % 4 == at[1] && o[2..] == at[2..])
}

/// A concatenation of an 8-channel convolution, BatchNorm and ReLU with a 3x3 max pool at
/// stride 1 (of 4 channels), in training: the BatchNorm spreads the NaN over its channels.
fn conv_bn_and_pool_training(at: &[usize], o: &[usize]) -> Option<bool> {
    match o[1] < 8 {
        true => Some(true),
        false => Some(o[1] - 8 == at[1] && near(at, o) == Some(true)),
    }
}

/// [`conv_bn_and_pool_training`] in inference: the convolution's channels near the NaN.
fn conv_bn_and_pool_inference(at: &[usize], o: &[usize]) -> Option<bool> {
    match o[1] < 8 {
        true => near(at, o),
        false => conv_bn_and_pool_training(at, o),
    }
}

fn conv(filters: usize) -> Conv2D {
    Conv2D::new(filters, 3).padding(Padding::Same)
}

fn conv_bn_relu(filters: usize) -> Sequential {
    Sequential::new()
        .add(conv(filters).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
}

/// Every layer and fused pattern, on images of 4 channels (16 for Winograd's convolutions,
/// which want 16 or more on both sides) or 12 features.
fn cases() -> Vec<Case> {
    const IMAGES: &[usize] = &[2, 4, 6, 6];
    const WIDE: &[usize] = &[2, 16, 6, 6];
    let case = |name, net, input, (train, infer): (Rule, Rule), grad_at_nan| Case {
        name,
        net,
        input,
        train,
        infer,
        grad_at_nan,
    };
    let one = |layer: Box<dyn super::LayerSpec>| Sequential::new().add(layer);
    vec![
        case(
            "relu",
            one(Activation::Relu.boxed()),
            IMAGES,
            (same, same),
            Some(1.0),
        ),
        case(
            "leaky relu",
            one(Activation::LeakyRelu(0.1).boxed()),
            IMAGES,
            (same, same),
            None,
        ),
        case(
            "dense + relu",
            one(Dense::new(8).activation(Activation::Relu).boxed()),
            &[2, 12],
            (sample, sample),
            None,
        ),
        case(
            "conv + relu, direct",
            one(conv(8).activation(Activation::Relu).boxed()),
            IMAGES,
            (near, near),
            None,
        ),
        case(
            "conv + relu, Winograd",
            one(conv(16).activation(Activation::Relu).boxed()),
            WIDE,
            (at_least_near, at_least_near),
            None,
        ),
        case(
            "conv + bn + relu, direct",
            conv_bn_relu(8),
            IMAGES,
            (all, near),
            None,
        ),
        case(
            "conv + bn + relu, Winograd",
            conv_bn_relu(16),
            WIDE,
            (all, at_least_near),
            None,
        ),
        case(
            "bn",
            one(BatchNormalization::new().boxed()),
            IMAGES,
            (channel, same),
            None,
        ),
        case(
            "bn + relu",
            Sequential::new()
                .add(BatchNormalization::new())
                .add(Activation::Relu),
            IMAGES,
            (channel, same),
            None,
        ),
        case(
            "max pool 2",
            one(MaxPooling2D::new(2).boxed()),
            IMAGES,
            (window_2, window_2),
            Some(1.0),
        ),
        case(
            "max pool 3/2 same",
            one(MaxPooling2D::new(3)
                .stride(2)
                .padding(Padding::Same)
                .boxed()),
            IMAGES,
            (window_3_2, window_3_2),
            Some(2.0),
        ),
        case(
            "average pool 2",
            one(AveragePooling2D::new(2).boxed()),
            IMAGES,
            (window_2, window_2),
            None,
        ),
        case(
            "global average pool",
            one(GlobalAveragePooling2D.boxed()),
            IMAGES,
            (plane, plane),
            None,
        ),
        case(
            "add + relu",
            Sequential::new()
                .add(Add::new([Identity.boxed(), Identity.boxed()]))
                .add(Activation::Relu),
            IMAGES,
            (same, same),
            Some(2.0),
        ),
        case(
            "concat",
            one(Concat::new([Identity.boxed(), Activation::Relu.boxed()]).boxed()),
            IMAGES,
            (both_halves, both_halves),
            Some(2.0),
        ),
        case(
            "concat of conv + bn + relu and a max pool",
            one(Concat::new([
                conv_bn_relu(8).boxed(),
                MaxPooling2D::new(3)
                    .stride(1)
                    .padding(Padding::Same)
                    .boxed(),
            ])
            .boxed()),
            IMAGES,
            (conv_bn_and_pool_training, conv_bn_and_pool_inference),
            None,
        ),
    ]
}

#[test]
fn a_nan_propagates_through_every_layer_on_every_path() -> Result<()> {
    for case in cases() {
        check_nans(&case)?;
    }
    Ok(())
}
