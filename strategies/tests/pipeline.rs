//! `PipelineStrategy` against one device on the equivalence run (470 digits at a global batch
//! of 24: 19 steps and a short one of 14): stages and micro-batches reorder the gradient sums
//! and nothing else, under both schedules, with gradient accumulation too, for `Sequential` and
//! functional models; batch normalisation per micro-batch is one device's
//! gradient accumulation over the same micro-batches; weights and training states move between
//! a pipeline and one device; a bad split is a clear error.

use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::pipeline::{Balance, PipelineStrategy, Schedule, StageSplit};

use kandle_testing::strategies as support;
use support::equivalence_run::{bn_cnn, compile, plain_cnn, three_in_two_out, train, SAMPLES};
use support::{one_device_reference, relative_difference};

/// `stages` stages on the CPU cut at `starts`, `micro` micro-batches under `schedule`.
fn pipeline(starts: &[&str], micro: usize, schedule: Schedule) -> anyhow::Result<PipelineStrategy> {
    Ok(PipelineStrategy::cpu(starts.len() + 1)?
        .micro_batches(micro)
        .schedule(schedule)
        .split(StageSplit::at(starts.iter().copied())))
}

/// A functional model with a residual block: stages may start before the block (one tensor,
/// the block's input, flows there) and after it, not inside it (two do).
fn residual_cnn() -> kandle::functional::Functional {
    use kandle::functional::{add, Functional, Input, LayerCall};
    let build = || -> kandle::Result<Functional> {
        let image = Input::new(&[1, 8, 8]).tensor();
        let a = Conv2D::new(6, 3)
            .padding(Padding::Same)
            .named("conv_a")
            .call(&image)?;
        let a = Activation::Relu.named("block_in").call(&a)?;
        let b = Conv2D::new(6, 3)
            .padding(Padding::Same)
            .named("conv_b")
            .call(&a)?;
        let b = Activation::Relu.call(&b)?;
        let c = Conv2D::new(6, 3)
            .padding(Padding::Same)
            .named("conv_c")
            .call(&b)?;
        let sum = Activation::Relu.call(&add(&[&a, &c])?)?;
        let pooled = MaxPooling2D::new(2).named("pool").call(&sum)?;
        let h = Dense::new(16)
            .named("hidden")
            .call(&Flatten.call(&pooled)?)?;
        let h = Activation::Relu.call(&h)?;
        let y = Activation::Softmax.call(&Dense::new(10).call(&h)?)?;
        Functional::new([&image], [&y])
    };
    build().expect("the residual CNN is a valid model")
}

/// A functional model cut before and after its residual block trains as one device.
#[test]
fn functional_stages_train_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(residual_cnn, SAMPLES)?;
    let runs = [
        ("conv_b", pipeline(&["conv_b"], 4, Schedule::OneFOneB)?),
        (
            "conv_b, pool",
            pipeline(&["conv_b", "pool"], 2, Schedule::GPipe)?,
        ),
        (
            "balanced",
            PipelineStrategy::cpu(3)?.split(StageSplit::Balanced(Balance::Time)),
        ),
    ];
    for (what, strategy) in &runs {
        let weights = train(residual_cnn(), strategy, SAMPLES)?.get_weights()?;
        reference.assert_matches(&weights, &format!("functional, stages at {what}"))?;
        let difference = relative_difference(&reference.weights, &weights)?;
        assert!(difference < 1e-5, "{what}: {difference:.2e}");
    }
    let model = train(residual_cnn(), &runs[1].1, SAMPLES)?;
    let layers: Vec<(&str, &str)> = model
        .summary()?
        .stages
        .iter()
        .map(|s| (s.layers.0.as_str(), s.layers.1.as_str()))
        .collect();
    assert_eq!(layers[1].0, "conv_b");
    assert_eq!(layers[2].0, "pool");
    Ok(())
}

/// Within the float32 spread of a reordered run, and 1e-5 of the largest magnitude.
#[test]
fn stages_and_micro_batches_train_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(plain_cnn, SAMPLES)?;
    let mut runs: Vec<(String, PipelineStrategy)> = Vec::new();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for micro in [1, 2, 4] {
            runs.push((
                format!("2 stages, M = {micro}, {schedule}"),
                pipeline(&["dense_1"], micro, schedule)?,
            ));
        }
        for micro in [2, 4] {
            runs.push((
                format!("3 stages, M = {micro}, {schedule}"),
                pipeline(&["max_pooling2d_1", "dense_2"], micro, schedule)?,
            ));
        }
    }
    let accumulating = pipeline(&["dense_1"], 2, Schedule::OneFOneB)?;
    let weights =
        support::equivalence_run::train_accumulating(plain_cnn(), &accumulating, SAMPLES, 2)?
            .get_weights()?;
    reference.assert_matches(&weights, "2 stages, M = 2, accumulating 2 batches")?;
    for balance in [Balance::Parameters, Balance::Time] {
        let strategy = PipelineStrategy::cpu(2)?.split(StageSplit::Balanced(balance));
        runs.push((format!("2 stages balanced by {balance:?}"), strategy));
    }
    for (what, strategy) in &runs {
        let weights = train(plain_cnn(), strategy, SAMPLES)?.get_weights()?;
        reference.assert_matches(&weights, what)?;
        let difference = relative_difference(&reference.weights, &weights)?;
        assert!(difference < 1e-5, "{what}: {difference:.2e}");
    }
    Ok(())
}

/// Batch normalisation normalises each micro-batch with its own statistics and moves the
/// moving statistics on once per micro-batch: one device's gradient accumulation over the same
/// micro-batches, moving statistics included (480 digits: 20 batches of 24, two micro-batches of
/// 12 each).
#[test]
fn batch_norm_per_micro_batch_is_one_devices_accumulation() -> anyhow::Result<()> {
    let samples = 480;
    let accumulated = support::equivalence_run::train_accumulating(
        bn_cnn(),
        &kandle::OneDeviceStrategy::cpu(),
        samples,
        2,
    )?
    .get_weights()?;
    let whole = train(bn_cnn(), &kandle::OneDeviceStrategy::cpu(), samples)?.get_weights()?;
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let strategy = pipeline(&["flatten_1"], 2, schedule)?;
        let piped = train(bn_cnn(), &strategy, samples)?.get_weights()?;
        let to_accumulated = relative_difference(&accumulated, &piped)?;
        let to_whole = relative_difference(&whole, &piped)?;
        eprintln!(
            "{schedule}: {to_accumulated:.2e} from accumulation, {to_whole:.2e} from one batch"
        );
        assert!(to_accumulated < 1e-5, "{schedule}: {to_accumulated:.2e}");
        assert!(
            to_whole > 1e-3,
            "per-micro-batch statistics changed nothing: {to_whole:.2e}"
        );
    }
    Ok(())
}

/// What each stage did: a report per step, each stage holding the micro-batches its schedule
/// says (GPipe: all on the first stage; 1F1B: the stages from it to the last), and a summary
/// with a line per stage.
#[test]
fn reports_and_summary_show_each_stage() -> anyhow::Result<()> {
    for (schedule, held) in [
        (Schedule::GPipe, [4, 4, 1]),
        (Schedule::OneFOneB, [3, 2, 1]),
    ] {
        let strategy = pipeline(&["max_pooling2d_1", "dense_2"], 4, schedule)?;
        let model = train(plain_cnn(), &strategy, SAMPLES)?;
        let report = strategy.last_step().expect("a step ran");
        assert_eq!(report.micro_batches, 4);
        let peaks: Vec<usize> = report.stages.iter().map(|s| s.peak_in_flight).collect();
        assert_eq!(peaks, held, "{schedule}");
        let idle = report.idle_fraction();
        assert!((0.0..1.0).contains(&idle), "{schedule}: idle {idle}");
        let summary = model.summary()?;
        let stage_held: Vec<usize> = summary
            .stages
            .iter()
            .map(|s| s.micro_batches_held)
            .collect();
        assert_eq!(stage_held, held);
        let layers: Vec<(&str, &str)> = summary
            .stages
            .iter()
            .map(|s| (s.layers.0.as_str(), s.layers.1.as_str()))
            .collect();
        assert_eq!(
            layers,
            [
                ("conv2d_1", "relu_1"),
                ("max_pooling2d_1", "relu_2"),
                ("dense_2", "softmax_1")
            ]
        );
        let params: usize = summary.stages.iter().map(|s| s.params).sum();
        assert_eq!(params, summary.total());
        let text = summary.to_string();
        assert!(
            text.contains("stage 2 on cpu: dense_2 to softmax_1"),
            "{text}"
        );
    }
    Ok(())
}

/// Weights and training states written under a pipeline load on one device and the reverse;
/// `evaluate` and `predict` agree.
#[test]
fn states_move_between_a_pipeline_and_one_device() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let strategy = pipeline(&["dense_1"], 3, Schedule::OneFOneB)?;
    let mut piped = train(plain_cnn(), &strategy, SAMPLES)?;
    let path = dir.path().join("piped.safetensors");
    piped.save(&path)?;
    let one = kandle::OneDeviceStrategy::cpu();
    let mut single = compile(plain_cnn(), Sgd::new(0.05).momentum(0.9), &one, 9)?;
    single.load(&path)?;
    assert_eq!(single.get_weights()?.len(), piped.get_weights()?.len());
    assert!(relative_difference(&piped.get_weights()?, &single.get_weights()?)? == 0.0);
    let (x, y) = kandle::data::digits::load()?
        .subset(&(0..100).collect::<Vec<_>>())?
        .to_tensors()?;
    let data = kandle::data::InMemoryDataset::new(x.clone(), y)?;
    let a = piped.evaluate(&data, 32)?;
    let b = single.evaluate(&data, 32)?;
    for (key, value) in a.iter() {
        let other = b.get(key).expect("the same logs");
        assert!(
            (value - other).abs() < 1e-5,
            "{key}: {value} against {other}"
        );
    }
    let pa = piped.predict(&x, 32)?;
    let pb = single.predict(&x, 32)?;
    let gap = (pa - pb)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(gap < 1e-6, "predictions differ by {gap}");
    // The reverse: one device's state, optimizer included, into a pipeline of three stages.
    let back = dir.path().join("single.safetensors");
    single.save(&back)?;
    let mut again = compile(
        plain_cnn(),
        Sgd::new(0.05).momentum(0.9),
        &pipeline(&["max_pooling2d_1", "dense_2"], 2, Schedule::GPipe)?,
        11,
    )?;
    again.load(&back)?;
    let weights: Weights = again.get_weights()?;
    assert!(relative_difference(&single.get_weights()?, &weights)? == 0.0);
    Ok(())
}

/// A split that names no layer, a stage without variables, more stages than layers, a cut
/// inside a residual block, a model of three inputs and no micro-batch: errors that say what is
/// wrong.
#[test]
fn bad_splits_are_clear_errors() -> anyhow::Result<()> {
    let sgd = || Sgd::new(0.1);
    let build = |strategy: &PipelineStrategy| compile(plain_cnn(), sgd(), strategy, 0).map(|_| ());
    let error = |r: kandle::Result<()>| r.expect_err("must fail").to_string();
    let unknown = error(build(&pipeline(&["dense_9"], 2, Schedule::GPipe)?));
    assert!(
        unknown.contains("`dense_9`") && unknown.contains("conv2d_1"),
        "{unknown}"
    );
    let empty = error(build(&pipeline(
        &["max_pooling2d_1", "dense_1"],
        2,
        Schedule::GPipe,
    )?));
    assert!(
        empty.contains("stage 1 (max_pooling2d_1, flatten_1) has no variables"),
        "{empty}"
    );
    let order = error(build(&pipeline(
        &["dense_2", "dense_1"],
        2,
        Schedule::GPipe,
    )?));
    assert!(order.contains("out of order"), "{order}");
    let many = error(build(&PipelineStrategy::cpu(9)?));
    assert!(
        many.contains("9 stages") && many.contains("has 8"),
        "{many}"
    );
    let graph = error(
        compile(
            residual_cnn(),
            sgd(),
            &pipeline(&["conv_c"], 2, Schedule::GPipe)?,
            0,
        )
        .map(|_| ()),
    );
    assert!(
        graph.contains("cannot start at `conv_c`") && graph.contains("block_in"),
        "{graph}"
    );
    let inputs =
        error(compile(three_in_two_out(), sgd(), &PipelineStrategy::cpu(2)?, 0).map(|_| ()));
    assert!(inputs.contains("one input"), "{inputs}");
    let none = error(build(&PipelineStrategy::cpu(2)?.micro_batches(0)));
    assert!(none.contains("at least one micro-batch"), "{none}");
    Ok(())
}
