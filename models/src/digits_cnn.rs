//! A small convolutional network for 8x8 single-channel images (the digits set).

use kandle::layers::{
    Activation, BatchNormalization, Conv2D, Dense, Dropout, Flatten, MaxPooling2D, Padding,
    Sequential,
};

/// Conv(32, 3x3 same) → BN → ReLU → Conv(32, 3x3 same) → BN → ReLU → MaxPool 2 → Dropout 0.25 →
/// Flatten → Dense(64) → ReLU → Dense(`classes`) → softmax. About 40k parameters; reaches 97%+
/// on the digits test split in a few epochs on a CPU.
pub fn digits_cnn(classes: usize) -> Sequential {
    Sequential::new()
        .add(Conv2D::new(32, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Conv2D::new(32, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Dropout::new(0.25))
        .add(Flatten)
        .add(Dense::new(64))
        .add(Activation::Relu)
        .add(Dense::new(classes))
        .add(Activation::Softmax)
}
