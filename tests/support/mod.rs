//! What kandle's integration tests share.

use kandle::prelude::*;

/// The digits CNN that reaches 97% test accuracy in 12 epochs of Adam at 3e-3 (batches of 32):
/// a convolution with batch norm, max pooling, a dense layer with dropout, a softmax.
pub fn digits_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(32, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(64))
        .add(Activation::Relu)
        .add(Dropout::new(0.2))
        .add(Dense::new(10))
        .add(Activation::Softmax)
}
