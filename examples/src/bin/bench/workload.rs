//! What `bench` times: a network (`--model`) on square images of one size (`--image-size`).
//!
//! At 32x32 the networks are CIFAR-10's (10 classes; ResNet-18 with the small-image stem, a 3x3
//! convolution and no max pooling), as the CIFAR-10 binaries train them. At any other size a
//! ResNet is torchvision's ImageNet network (the 7x7 stride-2 stem, the 3x3 stride-2 max pool,
//! 1,000 classes): the transfer-learning workload, e.g. `--model resnet50 --image-size 224`.
//! ResNet-50 is always the ImageNet network; MiniGoogLeNet takes 32x32 images only.

use anyhow::{bail, Result};
use clap::ValueEnum;
use kandle::Network;
use kandle_examples::CifarModel;
use kandle_models::{Depth, Head, ResNet};

/// The networks `bench` can time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchModel {
    /// MiniGoogLeNet, as the Keras multi-GPU tutorial defines it (a Sequential).
    MiniGooglenet,
    /// MiniGoogLeNet as a functional model (the same variables and outputs).
    MiniGooglenetFunctional,
    /// ResNet-18: CIFAR-10's at 32x32, torchvision's ImageNet network at other sizes.
    Resnet18,
    /// ResNet-50, torchvision's ImageNet network (bottleneck blocks).
    Resnet50,
}

/// A network and the side of its square images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// The network.
    pub model: BenchModel,
    /// Height and width of the images.
    pub image_size: usize,
}

/// The side of CIFAR-10's images.
const CIFAR_SIZE: usize = 32;

impl Workload {
    /// `model` on `image_size` images (default: 32, or 224 for ResNet-50). MiniGoogLeNet at
    /// another size than 32 is an error.
    pub fn new(model: BenchModel, image_size: Option<usize>) -> Result<Self> {
        let default = match model {
            BenchModel::Resnet50 => 224,
            _ => CIFAR_SIZE,
        };
        let image_size = image_size.unwrap_or(default);
        if image_size == 0 {
            bail!("--image-size must be at least 1");
        }
        if matches!(
            model,
            BenchModel::MiniGooglenet | BenchModel::MiniGooglenetFunctional
        ) && image_size != CIFAR_SIZE
        {
            bail!("--model {model:?} takes 32x32 images only, not --image-size {image_size}");
        }
        Ok(Self { model, image_size })
    }

    /// CIFAR-10's MiniGoogLeNet.
    pub fn mini_googlenet() -> Self {
        Self {
            model: BenchModel::MiniGooglenet,
            image_size: CIFAR_SIZE,
        }
    }

    /// Whether this is one of CIFAR-10's networks (10 classes, the small-image stem).
    pub fn is_cifar(&self) -> bool {
        self.image_size == CIFAR_SIZE && self.model != BenchModel::Resnet50
    }

    /// The ResNet's depth (`None` for MiniGoogLeNet).
    pub fn resnet_depth(&self) -> Option<Depth> {
        match self.model {
            BenchModel::Resnet18 => Some(Depth::ResNet18),
            BenchModel::Resnet50 => Some(Depth::ResNet50),
            _ => None,
        }
    }

    /// Classes of the softmax head.
    pub fn classes(&self) -> usize {
        if self.is_cifar() {
            10
        } else {
            1000
        }
    }

    /// The images' `(channels, height, width)`.
    pub fn input_shape(&self) -> [usize; 3] {
        [3, self.image_size, self.image_size]
    }

    /// The network.
    pub fn network(&self) -> kandle::Result<Network> {
        Ok(match (self.model, self.is_cifar()) {
            (BenchModel::MiniGooglenet, _) => CifarModel::MiniGooglenet.network()?,
            (BenchModel::MiniGooglenetFunctional, _) => {
                CifarModel::MiniGooglenetFunctional.network()?
            }
            (BenchModel::Resnet18, true) => CifarModel::Resnet18.network()?,
            (BenchModel::Resnet18 | BenchModel::Resnet50, _) => {
                let depth = self.resnet_depth().unwrap_or(Depth::ResNet50);
                ResNet::new(depth)
                    .input_shape(&self.input_shape())
                    .head(Head::Softmax(self.classes()))
                    .build()?
                    .into()
            }
        })
    }

    /// Its name in titles, e.g. `ResNet-50 on 224x224 images`.
    pub fn title(&self) -> String {
        let name = match self.model {
            BenchModel::MiniGooglenet | BenchModel::MiniGooglenetFunctional => "MiniGoogLeNet",
            BenchModel::Resnet18 => "ResNet-18",
            BenchModel::Resnet50 => "ResNet-50",
        };
        let size = self.image_size;
        match self.is_cifar() {
            true => name.to_string(),
            false => format!("{name} on {size}x{size} images"),
        }
    }

    /// The model the PyTorch script builds for this workload (its `--model`, beside
    /// `--image-size`).
    pub fn pytorch_name(&self) -> &'static str {
        match self.model {
            BenchModel::MiniGooglenet | BenchModel::MiniGooglenetFunctional => "mini_googlenet",
            BenchModel::Resnet18 => "resnet18",
            BenchModel::Resnet50 => "resnet50",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_pick_cifar_or_imagenet_networks() -> Result<()> {
        let cifar = Workload::new(BenchModel::Resnet18, None)?;
        assert!(cifar.is_cifar());
        assert_eq!(
            cifar.network()?.summary(&cifar.input_shape())?.trainable,
            11_173_962
        );
        let imagenet = Workload::new(BenchModel::Resnet18, Some(224))?;
        assert_eq!((imagenet.is_cifar(), imagenet.classes()), (false, 1000));
        let summary = imagenet.network()?.summary(&imagenet.input_shape())?;
        assert_eq!(summary.trainable, 11_689_512);
        let resnet50 = Workload::new(BenchModel::Resnet50, None)?;
        assert_eq!(resnet50.image_size, 224);
        let summary = resnet50.network()?.summary(&resnet50.input_shape())?;
        assert_eq!(summary.trainable, 25_557_032);
        assert_eq!(resnet50.title(), "ResNet-50 on 224x224 images");
        let err = Workload::new(BenchModel::MiniGooglenet, Some(64)).expect_err("32 only");
        assert!(err.to_string().contains("--image-size 64"), "{err}");
        Ok(())
    }
}
