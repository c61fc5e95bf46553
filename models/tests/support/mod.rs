//! What `kandle-models`' integration tests share.

pub mod step_reference;
