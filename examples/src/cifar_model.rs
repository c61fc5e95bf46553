//! The networks the CIFAR-10 binaries train and time, chosen with `--model`.

use clap::ValueEnum;
use kandle::Network;
use kandle_models::{Depth, Head, ResNet};

/// A network for CIFAR-10's 32x32 colour images and 10 classes (softmax).
///
/// ```
/// use kandle_examples::CifarModel;
///
/// let summary = CifarModel::Resnet18.network()?.summary(&[3, 32, 32])?;
/// assert_eq!(summary.trainable, 11_173_962);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CifarModel {
    /// MiniGoogLeNet, as the Keras multi-GPU tutorial defines it, as a Sequential.
    MiniGooglenet,
    /// MiniGoogLeNet as a functional model (the same variables and outputs).
    MiniGooglenetFunctional,
    /// ResNet-18 with the small-image stem (a 3x3 convolution, no max pooling).
    Resnet18,
}

impl CifarModel {
    /// The network.
    pub fn network(self) -> kandle::Result<Network> {
        Ok(match self {
            CifarModel::MiniGooglenet => kandle_models::mini_googlenet(10).into(),
            CifarModel::MiniGooglenetFunctional => {
                kandle_models::mini_googlenet_functional(10)?.into()
            }
            CifarModel::Resnet18 => ResNet::new(Depth::ResNet18)
                .input_shape(&[3, 32, 32])
                .small_images()
                .head(Head::Softmax(10))
                .build()?
                .into(),
        })
    }

    /// Its name in titles and file names.
    pub fn title(self) -> &'static str {
        match self {
            CifarModel::MiniGooglenet | CifarModel::MiniGooglenetFunctional => "MiniGoogLeNet",
            CifarModel::Resnet18 => "ResNet-18",
        }
    }
}
