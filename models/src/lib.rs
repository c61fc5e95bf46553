//! # kandle-models
//!
//! Ready-made networks built from kandle layers. Each is a plain
//! [`Sequential`](kandle::layers::Sequential) recipe: compile it with any strategy.
//!
//! - [`mini_googlenet`]: MiniGoogLeNet for 32x32 colour images (CIFAR-10), with its building
//!   blocks [`conv_module`], [`inception_module`] and [`downsample_module`];
//! - [`digits_cnn`]: a small convolutional network for the 8x8 digits set;
//! - [`resnet18`] and [`resnet34`]: torchvision's ResNets of basic blocks ([`basic_block`]),
//!   residual blocks written as an `Add` of a residual branch and a shortcut.
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
pub use mini_googlenet::{conv_module, downsample_module, inception_module, mini_googlenet};
pub use resnet::{basic_block, resnet18, resnet34};
