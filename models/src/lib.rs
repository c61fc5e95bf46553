//! # kandle-models
//!
//! Ready-made networks built from kandle layers: [`Sequential`](kandle::layers::Sequential)
//! recipes and [`Functional`](kandle::functional::Functional) models. Compile any of them with
//! any strategy.
//!
//! - [`mini_googlenet`]: MiniGoogLeNet for 32x32 colour images (CIFAR-10), with its building
//!   blocks [`conv_module`], [`inception_module`] and [`downsample_module`], and
//!   [`mini_googlenet_functional`], the same network as a functional model;
//! - [`digits_cnn`]: a small convolutional network for the 8x8 digits set;
//! - [`ResNet`] (and [`resnet18`] ... [`resnet152`]): torchvision's ResNets as functional
//!   models, with torchvision's variable names, a choice of [`Head`] and a small-image variant
//!   for 32x32 inputs; their blocks [`basic_block`] and [`bottleneck_block`].
//!
//! ```
//! let summary = kandle_models::mini_googlenet(10).summary(&[3, 32, 32])?;
//! assert_eq!(summary.total(), 1_656_250);
//! # Ok::<(), kandle::Error>(())
//! ```

mod digits_cnn;
mod mini_googlenet;
mod resnet;

pub use digits_cnn::digits_cnn;
pub use mini_googlenet::{
    conv_module, downsample_module, inception_module, mini_googlenet, mini_googlenet_functional,
};
pub use resnet::{
    basic_block, bottleneck_block, resnet101, resnet152, resnet18, resnet34, resnet50, Depth, Head,
    ResNet,
};
