//! The equivalence run that the strategy tests and the worker programs (`kandle-mpi-check`,
//! `kandle-ps-check`) share: the models, and one epoch on digits
//! at a fixed global batch whose last step is short, in a fixed order of the samples or in the
//! same batches with each batch's samples reversed (an equivalent ordering, whose float32
//! spread sets the tests' tolerances).
//!
//! It uses kandle alone.

use kandle::functional::{add, concatenate, Functional, Input, PerOutput};
use kandle::prelude::*;
use kandle::{ComputePath, DTypePolicy, Network};

/// 470 samples at a global batch of 24: 19 full steps and a short one of 14.
pub const SAMPLES: usize = 470;
/// The global batch of every equivalence run.
pub const GLOBAL_BATCH: usize = 24;

/// A CNN without batch statistics.
pub fn plain_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(6, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(16))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// A CNN with two batch norms. Biases directly before a batch norm have a zero gradient in
/// exact arithmetic, so they only accumulate rounding noise; as usual, they are left out.
pub fn bn_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(6, 3).padding(Padding::Same).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Softmax)
}

/// A functional model with a residual sum whose ReLU it absorbs, a convolution shared by two
/// calls (its gradient the sum of both) and a concatenation of two branches.
pub fn graph_cnn() -> Functional {
    let build = || -> kandle::Result<Functional> {
        let image = Input::new(&[1, 8, 8]).tensor();
        let stem = Conv2D::new(4, 3).padding(Padding::Same).call(&image)?;
        let stem = Activation::Relu.call(&stem)?;
        let shared = Conv2D::new(4, 3)
            .padding(Padding::Same)
            .named("shared")
            .shared();
        let once = Activation::Relu.call(&shared.call(&stem)?)?;
        let twice = shared.call(&once)?;
        let residual = Activation::Relu.call(&add(&[&stem, &twice])?)?;
        let side = Conv2D::new(2, 1).call(&image)?;
        let joined = concatenate(&[&residual, &side])?;
        let pooled = MaxPooling2D::new(2).call(&joined)?;
        let flat = Flatten.call(&pooled)?;
        let probabilities = Activation::Softmax.call(&Dense::new(10).call(&flat)?)?;
        Functional::new([&image], [&probabilities])
    };
    // The graph is fixed: its checks cannot fail.
    build().expect("the equivalence graph is a valid model")
}

/// A model of three inputs (the digit image, its eight row means, and the column of each
/// row's brightest pixel as ids) and two outputs (`class`, the digit's class probabilities,
/// and `ink`, the image's standardised mean value), with a residual sum, a dense layer shared
/// by the image's and the rows' features, an embedding of the ids, and the class loss
/// weighted 1 and the ink loss 0.5 (see [`compile`]). Its data is [`digits_in_parts`].
pub fn three_in_two_out() -> Functional {
    let build = || -> kandle::Result<Functional> {
        let image = Input::new(&[1, 8, 8]).named("image").tensor();
        let rows = Input::new(&[8]).named("rows").tensor();
        let brightest = Input::new(&[8]).named("brightest").tensor();
        let stem =
            Activation::Relu.call(&Conv2D::new(4, 3).padding(Padding::Same).call(&image)?)?;
        let inner = Conv2D::new(4, 3).padding(Padding::Same).call(&stem)?;
        let residual = Activation::Relu.call(&add(&[&stem, &inner])?)?;
        let pooled = Flatten.call(&MaxPooling2D::new(4).call(&residual)?)?;
        let features = Dense::new(8).call(&pooled)?;
        let shared = Dense::new(8).named("shared").shared();
        let columns = Embedding::new(8, 2).call(&brightest)?;
        let columns = Dense::new(8).call(&Flatten.call(&columns)?)?;
        let both = add(&[&shared.call(&features)?, &shared.call(&rows)?, &columns])?;
        let both = Activation::Relu.call(&both)?;
        let class = Activation::Softmax
            .named("class")
            .call(&Dense::new(10).call(&both)?)?;
        let ink = Dense::new(1).named("ink").call(&both)?;
        Functional::new([&image, &rows, &brightest], [&class, &ink])
    };
    // The graph is fixed: its checks cannot fail.
    build().expect("the three-input graph is a valid model")
}

/// The digits as [`three_in_two_out`] takes them, each input a part of its own dtype: each
/// image (`f32`), its eight row means (`f16`) and the column of each row's brightest pixel
/// (`u32` ids, the first such column on a tie), named after the model's inputs; with its
/// class and its ink as the two targets (the image's mean value, standardised over `digits`:
/// mean 0, variance 1).
pub fn digits_in_parts(
    digits: &kandle::data::InMemoryDataset,
) -> kandle::Result<kandle::data::InMemoryDataset> {
    let (x, y) = digits.to_tensors()?;
    let rows = x
        .mean(3)?
        .flatten_from(1)?
        .to_dtype(candle_core::DType::F16)?;
    let ink = x.flatten_from(1)?.mean_keepdim(1)?;
    let centred = ink.broadcast_sub(&ink.mean_all()?)?;
    let std = centred.sqr()?.mean_all()?.sqrt()?;
    let ink = centred.broadcast_div(&std)?;
    let pixels = x.flatten_from(1)?.to_vec2::<f32>()?;
    let brightest: Vec<u32> = pixels
        .iter()
        .flat_map(|image| {
            image.chunks_exact(8).map(|row| {
                let top = row.iter().copied().fold(f32::MIN, f32::max);
                row.iter().position(|&v| v == top).unwrap_or(0) as u32
            })
        })
        .collect();
    let n = pixels.len();
    let brightest = candle_core::Tensor::from_vec(brightest, (n, 8), &candle_core::Device::Cpu)?;
    kandle::data::InMemoryDataset::from_named_parts(
        &[("image", x), ("rows", rows), ("brightest", brightest)],
        &[y, ink],
    )
}

/// `net` compiled under `strategy` with `optimizer`, sparse cross-entropy and accuracy, its
/// initial weights drawn from `seed`, built for digits (8x8 images).
pub fn compile<S, O>(
    net: impl Into<Network>,
    optimizer: O,
    strategy: &S,
    seed: u64,
) -> kandle::Result<Model>
where
    S: Strategy + Clone + 'static,
    O: kandle::optimizers::OptimizerConfig,
{
    let net = net.into();
    let mut model = if two_outputs(&net) {
        let losses = PerOutput::new()
            .loss("class", SparseCategoricalCrossentropy::new())
            .loss("ink", MeanSquaredError)
            .weight("ink", 0.5)
            .metric("class", Accuracy);
        net.compile(optimizer, losses, (), strategy)?
    } else {
        let mut model = net.compile(
            optimizer,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?;
        model.build(&[1, 8, 8])?;
        model
    };
    model = model.with_seed(seed)?;
    Ok(model)
}

/// Whether `net` is [`three_in_two_out`] (or another model of two outputs).
pub fn two_outputs(net: &Network) -> bool {
    net.output_names().is_some_and(|names| names.len() == 2)
}

/// The order in which an equivalence run takes the samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// A fixed pseudo-random order, the same in every run.
    Fixed,
    /// The batches of [`Order::Fixed`], each with its samples reversed: the same steps in exact
    /// arithmetic, summed in another order in float32.
    ReversedInBatches,
}

impl Order {
    /// The first `samples` digits in this order, for batches of `batch`.
    pub fn indices(self, samples: usize, batch: usize) -> Vec<usize> {
        // Knuth's multiplicative hash is a bijection on u32: distinct keys, a fixed shuffle.
        let mut order: Vec<usize> = (0..samples).collect();
        order.sort_by_key(|&i| (i as u32).wrapping_mul(2_654_435_761));
        if self == Order::ReversedInBatches {
            order.chunks_mut(batch).for_each(<[usize]>::reverse);
        }
        order
    }
}

/// Trains `net` under `strategy` for one epoch on the first `samples` digits at a global batch
/// of [`GLOBAL_BATCH`] in [`Order::Fixed`] (SGD with momentum, fixed seeds) and returns the
/// model. Fails if the
/// strategy's replicas do not divide the global batch, or the loss is not finite.
pub fn train<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
) -> kandle::Result<Model> {
    let (model, history) = fit(net, strategy, samples)?;
    match history.last("loss") {
        Some(loss) if loss.is_finite() => Ok(model),
        loss => Err(kandle::Error::invalid(format!(
            "the equivalence run ended with loss {loss:?}"
        ))),
    }
}

/// The run of [`train`], with its history and without checking the loss (a parameter
/// server's `fit` serves the workers and has no history).
pub fn fit<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
) -> kandle::Result<(Model, History)> {
    fit_on(net, strategy, samples, Run::plain(None, Order::Fixed))
}

/// The run of [`train`] on compute path `path` (`None`: `KANDLE_COMPUTE`'s) with the samples in
/// `order`.
pub fn train_on<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
    path: Option<ComputePath>,
    order: Order,
) -> kandle::Result<Model> {
    Ok(fit_on(net, strategy, samples, Run::plain(path, order))?.0)
}

/// The run of [`train`] in micro-batches of a `k`-th of [`GLOBAL_BATCH`], their gradients
/// accumulated over `k` batches (`gradient_accumulation_steps(k)`): the same updates as
/// [`train`]'s, the last group short as its last batch is.
pub fn train_accumulating<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
    k: usize,
) -> kandle::Result<Model> {
    train_with(net, strategy, samples, k, DTypePolicy::float32())
}

/// The run of [`train_accumulating`] under the dtype policy `policy`.
pub fn train_with<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
    k: usize,
    policy: DTypePolicy,
) -> kandle::Result<Model> {
    let (model, history) = fit_with(net, strategy, samples, k, policy)?;
    match history.last("loss") {
        Some(loss) if loss.is_finite() => Ok(model),
        loss => Err(kandle::Error::invalid(format!(
            "the accumulating run ended with loss {loss:?}"
        ))),
    }
}

/// The run of [`train_with`], with its history and without checking the loss.
pub fn fit_with<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
    k: usize,
    policy: DTypePolicy,
) -> kandle::Result<(Model, History)> {
    let run = Run {
        path: None,
        order: Order::Fixed,
        accumulation: k,
        policy,
    };
    fit_on(net, strategy, samples, run)
}

/// How an equivalence run trains besides its model and strategy.
struct Run {
    /// The compute path (`None`: `KANDLE_COMPUTE`'s).
    path: Option<ComputePath>,
    order: Order,
    /// Gradient accumulation steps (1: none).
    accumulation: usize,
    policy: DTypePolicy,
}

impl Run {
    fn plain(path: Option<ComputePath>, order: Order) -> Self {
        Self {
            path,
            order,
            accumulation: 1,
            policy: DTypePolicy::float32(),
        }
    }
}

fn fit_on<S: Strategy + Clone + 'static>(
    net: impl Into<Network>,
    strategy: &S,
    samples: usize,
    run: Run,
) -> kandle::Result<(Model, History)> {
    let Run {
        path,
        order,
        accumulation,
        policy,
    } = run;
    let replicas = strategy.num_replicas_in_sync();
    if !GLOBAL_BATCH.is_multiple_of(replicas * accumulation) {
        return Err(kandle::Error::invalid(format!(
            "{replicas} replicas and {accumulation} accumulation steps do not divide the global \
             batch of {GLOBAL_BATCH}"
        )));
    }
    let net = net.into();
    let mut data = kandle::data::digits::load()?.subset(&order.indices(samples, GLOBAL_BATCH))?;
    if two_outputs(&net) {
        data = digits_in_parts(&data)?;
    }
    let sgd = Sgd::new(0.05)
        .momentum(0.9)
        .gradient_accumulation_steps(accumulation);
    let mut model = compile(net, sgd, strategy, 5)?;
    if let Some(path) = path {
        model = model.with_compute_path(path)?;
    }
    model = model.with_dtype_policy(policy)?;
    let history = model.fit(
        &data,
        FitOptions {
            epochs: 1,
            batch_size_per_replica: GLOBAL_BATCH / (replicas * accumulation),
            shuffle: false,
            seed: Some(9),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    Ok((model, history))
}
