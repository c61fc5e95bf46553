//! Transfer learning as Keras teaches it, on a folder of images: an ImageNet-pretrained ResNet
//! without its classifier, frozen, under a new classifier; train the classifier; then unfreeze
//! the base and fine-tune everything at a low learning rate, the base's BatchNorm layers kept
//! in inference mode throughout (Keras's `base_model(x, training=False)`).
//!
//! ```text
//! cargo run --release -p kandle-examples --bin transfer_learning -- \
//!     --data-dir data/flower_photos --weights resnet152-394f9c45.pth --model resnet152 \
//!     --epochs 5 --fine-tune-epochs 5 --output plots/transfer_learning.png
//! ```
//!
//! `--data-dir` holds one folder of images per class. `--weights` is a torchvision state dict
//! of the chosen ResNet (`.pth` as torchvision downloads it, or safetensors); its names load
//! into the base under the prefix `base.`, its classifier `fc` is left out, and the load
//! report is printed. Without `--weights` the base starts from random weights, and the run
//! says so. The model: ImageNet's normalisation, random flips and random resized crops (in
//! training), the base with global average pooling, dropout, and a dense softmax classifier.
//! The run writes the curves of both phases (PNG), their CSV, and the fine-tuned weights.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use kandle::callbacks::{plot_history, CsvLogger};
use kandle::data::{Dataset, ImageFolder};
use kandle::functional::{Functional, Input};
use kandle::layers::{Normalization, RandomFlip, RandomResizedCrop, Rescaling};
use kandle::prelude::*;
use kandle::pretrained::ImportOptions;
use kandle_examples::StrategyKind;
use kandle_models::{Depth, Head, ResNet};

/// The pretrained networks `--model` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BaseModel {
    Resnet18,
    Resnet34,
    Resnet50,
    Resnet101,
    Resnet152,
}

impl BaseModel {
    fn depth(self) -> Depth {
        match self {
            BaseModel::Resnet18 => Depth::ResNet18,
            BaseModel::Resnet34 => Depth::ResNet34,
            BaseModel::Resnet50 => Depth::ResNet50,
            BaseModel::Resnet101 => Depth::ResNet101,
            BaseModel::Resnet152 => Depth::ResNet152,
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    about = "Transfer learning: a pretrained ResNet, frozen under a new classifier, then \
                   fine-tuned, on a folder of images per class"
)]
struct Args {
    /// A folder with one subfolder of images per class.
    #[arg(long)]
    data_dir: PathBuf,
    /// The pretrained weights: a torchvision state dict of the chosen ResNet (.pth or
    /// safetensors). Without it the base starts from random weights.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The base network.
    #[arg(long, value_enum, default_value = "resnet50")]
    model: BaseModel,
    /// Images are resized to this height and width.
    #[arg(long, default_value_t = 224, value_parser = kandle_examples::at_least_one())]
    image_size: usize,
    /// Epochs training the new classifier over the frozen base.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Epochs fine-tuning after unfreezing (0: none).
    #[arg(long, default_value_t = 5)]
    fine_tune_epochs: usize,
    /// Adam's learning rate while the base is frozen.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Adam's learning rate when fine-tuning.
    #[arg(long, default_value_t = 1e-5)]
    fine_tune_lr: f64,
    /// The layers of the base to unfreeze for fine-tuning, by torchvision name, comma
    /// separated (such as layer4 or layer3,layer4); default: the whole base.
    #[arg(long, value_delimiter = ',')]
    unfreeze: Vec<String>,
    /// Samples per replica per step.
    #[arg(long, default_value_t = 32, value_parser = kandle_examples::at_least_one())]
    batch_size_per_replica: usize,
    /// The fraction of the images kept for validation.
    #[arg(long, default_value_t = 0.2)]
    validation_split: f64,
    /// Replicas: GPUs when built with the cuda feature, otherwise CPU replicas.
    #[arg(long, default_value_t = 1, value_parser = kandle_examples::at_least_one())]
    gpus: usize,
    /// How training is distributed (default: one-device for one replica, mirrored otherwise).
    #[arg(long, value_enum)]
    strategy: Option<StrategyKind>,
    /// Stop each epoch after this many steps (smoke runs).
    #[arg(long, value_parser = kandle_examples::at_least_one())]
    max_steps_per_epoch: Option<usize>,
    /// Seed for the classifier's weights, the split, shuffling and augmentation.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The training-curve PNG; the CSV and the fine-tuned weights (safetensors) are written
    /// beside it.
    #[arg(long, default_value = "plots/transfer_learning.png")]
    output: PathBuf,
}

/// `path` with its extension replaced by `ext`.
fn sibling(path: &Path, ext: &str) -> PathBuf {
    path.with_extension(ext)
}

/// The model: preprocessing, the base (named `base`, frozen, its BatchNorm layers in
/// inference mode) and a new classifier.
fn network(args: &Args, classes: usize) -> Result<Functional> {
    let size = args.image_size;
    let base = ResNet::new(args.model.depth())
        .input_shape(&[3, size, size])
        .head(Head::AveragePooling)
        .build()?;
    let image = Input::new(&[3, size, size]).named("image").tensor();
    let x = Rescaling::new(1.0 / 255.0, 0.0).call(&image)?;
    let x = Normalization::imagenet().call(&x)?;
    let x = RandomFlip::horizontal().call(&x)?;
    let x = RandomResizedCrop::new(size, size)
        .scale(0.5, 1.0)
        .call(&x)?;
    let features = base
        .named("base")
        .trainable(false)
        .inference_mode()
        .call(&x)?;
    let x = Dropout::new(0.2).call(&features)?;
    let out = Dense::new(classes)
        .activation(Activation::Softmax)
        .named("classifier")
        .call(&x)?;
    Ok(Functional::new([&image], [&out])?)
}

/// Loads torchvision's weights into the base and prints the report; every variable the file
/// lacks must lie outside the base.
fn load_base(model: &mut Model, weights: &Path, name: BaseModel) -> Result<()> {
    let options = ImportOptions::new()
        .rename_prefix("", "base.")
        .allow_unexpected(true)
        .allow_missing(true);
    let report = model.load_weights_from(weights, &options)?;
    println!("weights from {}:\n{report}", weights.display());
    let missing_in_base: Vec<&String> = report
        .missing
        .iter()
        .filter(|n| n.starts_with("base."))
        .collect();
    if !missing_in_base.is_empty() {
        bail!(
            "{} lacks {} of the base's variables (the first: {}): is it the state dict of \
             {name:?}?",
            weights.display(),
            missing_in_base.len(),
            missing_in_base[0],
        );
    }
    Ok(())
}

/// Both phases' epochs as one history, for one plot.
fn joined(first: &History, second: &History) -> History {
    History {
        epochs: first.epochs.iter().chain(&second.epochs).copied().collect(),
        logs: first.logs.iter().chain(&second.logs).cloned().collect(),
        preempted: second.preempted.clone(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let (train, validation) = ImageFolder::from_dir(&args.data_dir)
        .image_size(args.image_size, args.image_size)
        .validation_split(args.validation_split)
        .seed(args.seed)
        .build_split()?;
    let classes = train.class_names().len();
    println!(
        "{} training and {} validation images of {classes} classes ({})",
        train.len(),
        validation.len(),
        train.class_names().join(", ")
    );

    let kind = args.strategy.unwrap_or(if args.gpus == 1 {
        StrategyKind::OneDevice
    } else {
        StrategyKind::Mirrored
    });
    let strategy = kandle_examples::build_strategy(kind, args.gpus)?;
    let mut model = network(&args, classes)?
        .compile(
            Adam::new(args.lr),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &strategy,
        )?
        .with_seed(args.seed)?;
    match &args.weights {
        Some(weights) => load_base(&mut model, weights, args.model)?,
        None => println!(
            "no --weights: the base starts from random weights, so this shows the recipe, not \
             what pretraining brings"
        ),
    }
    let summary = model.summary()?;
    println!(
        "{:?}, frozen: {} trainable and {} non-trainable parameters; strategy {} with {} \
         replica(s)",
        args.model,
        summary.trainable,
        summary.non_trainable,
        strategy.name(),
        strategy.num_replicas_in_sync()
    );

    let csv = sibling(&args.output, "csv");
    let options = |epochs, initial_epoch, append| FitOptions {
        epochs,
        initial_epoch,
        batch_size_per_replica: args.batch_size_per_replica,
        validation: Some(&validation),
        seed: Some(args.seed),
        steps_per_epoch: args.max_steps_per_epoch,
        callbacks: vec![CsvLogger::new(&csv).append(append).boxed()],
        ..Default::default()
    };
    println!("training the classifier over the frozen base");
    let head = model.fit(&train, options(args.epochs, 0, false))?;

    let unfreeze: Vec<String> = match args.unfreeze.is_empty() {
        true => vec!["base".to_string()],
        false => args.unfreeze.iter().map(|n| format!("base.{n}")).collect(),
    };
    let names: Vec<&str> = unfreeze.iter().map(String::as_str).collect();
    model.set_trainable(&names, true)?;
    model.set_learning_rate(args.fine_tune_lr)?;
    let summary = model.summary()?;
    println!(
        "fine-tuning {} at learning rate {}: {} trainable parameters",
        names.join(", "),
        args.fine_tune_lr,
        summary.trainable
    );
    let total = args.epochs + args.fine_tune_epochs;
    let tuned = model.fit(&train, options(total, args.epochs, true))?;

    let history = joined(&head, &tuned);
    if history.epochs.is_empty() {
        println!("trained no epoch, so wrote no curves, CSV or weights");
        return Ok(());
    }
    let title = format!(
        "{:?} on {} classes: classifier, then fine-tuning from epoch {}",
        args.model, classes, args.epochs
    );
    plot_history(&history, &args.output, &title)?;
    let weights = sibling(&args.output, "safetensors");
    model.save_weights(&weights)?;
    if let Some(last) = history.logs.last() {
        println!(
            "final validation accuracy {:.4}",
            last.get("val_accuracy").unwrap_or(f64::NAN)
        );
    }
    println!(
        "wrote {}, {} and {}",
        args.output.display(),
        csv.display(),
        weights.display()
    );
    Ok(())
}
