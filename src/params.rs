//! Named parameters: the variables a built network owns, their initialisers and their names.
//!
//! A network built from a recipe (see [`crate::layers`]) keeps every variable in a
//! [`ParamStore`] under a stable, readable name such as `conv2d_1.weight` or
//! `inception_2.branch_3x3.bn.running_mean`. The names depend only on the recipe, never on the
//! device or the strategy, so a checkpoint written by one strategy loads under any other.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cross_replica::ReplicaHandle;
use crate::{ComputePath, Error, Result};

/// Weights by name: what checkpoints hold and what strategies copy between replicas.
pub type Weights = BTreeMap<String, Tensor>;

/// How a new variable is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Every element set to the value.
    Constant(f64),
    /// Glorot (Xavier) uniform, Keras's default for kernels: `U(-l, l)` with
    /// `l = sqrt(6 / (fan_in + fan_out))`.
    GlorotUniform {
        /// Inputs feeding one output unit (`in_channels * kh * kw` for a convolution).
        fan_in: usize,
        /// Outputs fed by one input unit (`out_channels * kh * kw` for a convolution).
        fan_out: usize,
    },
    /// He (Kaiming) normal: `N(0, 2 / fan_in)`.
    HeNormal {
        /// Inputs feeding one output unit.
        fan_in: usize,
    },
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
}

impl Init {
    fn sample(&self, count: usize, rng: &mut StdRng) -> Vec<f32> {
        match *self {
            Init::Zeros => vec![0.0; count],
            Init::Ones => vec![1.0; count],
            Init::Constant(v) => vec![v as f32; count],
            Init::GlorotUniform { fan_in, fan_out } => {
                let limit = (6.0 / (fan_in + fan_out).max(1) as f64).sqrt();
                uniform(count, -limit, limit, rng)
            }
            Init::Uniform { low, high } => uniform(count, low, high, rng),
            Init::HeNormal { fan_in } => {
                let std = (2.0 / fan_in.max(1) as f64).sqrt();
                (0..count)
                    .map(|_| (standard_normal(rng) * std) as f32)
                    .collect()
            }
        }
    }
}

fn uniform(count: usize, low: f64, high: f64, rng: &mut StdRng) -> Vec<f32> {
    (0..count)
        .map(|_| rng.random_range(low..high) as f32)
        .collect()
}

/// Box-Muller: one standard normal sample.
fn standard_normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// One named variable.
#[derive(Debug, Clone)]
pub struct Param {
    /// The full, stable name, e.g. `conv2d_1.weight`.
    pub name: String,
    /// The variable itself. Cloning a `Var` shares its storage.
    pub var: Var,
    /// Whether the optimizer updates it. Batch-norm moving statistics and the variables of
    /// frozen layers are not trainable.
    pub trainable: bool,
    /// Whether it is a statistic that the layer itself updates during training (a moving mean
    /// or variance), which replicas must average to stay in agreement.
    pub statistic: bool,
    /// Whether it is the position of a random generator (where a dropout layer's masks are in
    /// their sequence), or the state of mixed precision's loss scale: saved with the weights,
    /// so that a resumed run continues as an uninterrupted one would, kept by each replica (a
    /// parameter server's workers keep their own), and not a parameter (the summary does not
    /// count it).
    pub generator: bool,
}

/// The variables of one built network, in creation order, addressed by name.
#[derive(Debug, Clone, Default)]
pub struct ParamStore {
    params: Vec<Param>,
    index: BTreeMap<String, usize>,
    /// Names a weights file may lack, or hold without the store having them: state kept beside
    /// the weights (mixed precision's loss scale), marked by whoever builds the store.
    bookkeeping: BTreeSet<String>,
}

impl ParamStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks `name` as bookkeeping: a weights file checked against this store
    /// ([`Self::check_compatible`]) may lack it, or hold it when the store has no such
    /// variable, so that weights move between models that keep it and models that do not.
    pub fn mark_bookkeeping(&mut self, name: &str) {
        self.bookkeeping.insert(name.to_string());
    }

    /// Adds a trainable or frozen variable. Fails if the name is taken.
    pub fn insert(&mut self, name: String, var: Var, trainable: bool) -> Result<()> {
        self.insert_param(Param {
            name,
            var,
            trainable,
            statistic: false,
            generator: false,
        })
    }

    /// Adds a variable. Fails if the name is taken.
    pub fn insert_param(&mut self, param: Param) -> Result<()> {
        let name = param.name.clone();
        if self.index.contains_key(&name) {
            return Err(Error::invalid(format!(
                "two variables are named `{name}`: give the layers distinct names"
            )));
        }
        self.index.insert(name, self.params.len());
        self.params.push(param);
        Ok(())
    }

    /// All variables in creation order.
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }

    /// The variable called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether the store holds no variable.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The trainable variables, in creation order: what an optimizer updates.
    pub fn trainable_vars(&self) -> Vec<Var> {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.var.clone())
            .collect()
    }

    /// The variables that are not trainable (moving statistics, frozen layers).
    pub fn non_trainable(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| !p.trainable)
    }

    /// The moving statistics that layers update during training, in creation order.
    pub fn statistics(&self) -> Vec<Var> {
        self.params
            .iter()
            .filter(|p| p.statistic)
            .map(|p| p.var.clone())
            .collect()
    }

    /// `(trainable, non_trainable)` element counts of the parameters whose names start with
    /// `prefix` (all of them for `""`); generator positions are not parameters.
    pub fn count(&self, prefix: &str) -> (usize, usize) {
        self.params
            .iter()
            .filter(|p| !p.generator)
            .filter(|p| prefix.is_empty() || p.name.starts_with(prefix))
            .fold((0, 0), |(t, n), p| {
                let size = p.var.elem_count();
                if p.trainable {
                    (t + size, n)
                } else {
                    (t, n + size)
                }
            })
    }

    /// A detached copy of every variable's current value, by name, on its device.
    pub fn weights(&self) -> Result<Weights> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.var.as_tensor().detach().copy()?)))
            .collect()
    }

    /// Overwrites every variable with the tensor of the same name, moved to the variable's
    /// device and dtype. `weights` must name exactly this store's variables, with the same
    /// shapes; otherwise nothing is changed and the error lists every mismatch.
    pub fn assign(&self, weights: &Weights) -> Result<()> {
        self.check_compatible(weights)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        for p in &self.params {
            // Only mixed precision's loss scale may be absent (weights saved under another
            // policy): it keeps its value.
            let Some(value) = weights.get(&p.name) else {
                continue;
            };
            p.var
                .set(&value.to_device(p.var.device())?.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }

    /// Checks that `weights` holds exactly this store's names with the same shapes; the error
    /// text lists missing, unexpected and mis-shaped tensors. The names marked as bookkeeping
    /// ([`Self::mark_bookkeeping`]) alone may be missing or unexpected.
    pub fn check_compatible(&self, weights: &Weights) -> std::result::Result<(), String> {
        let missing: Vec<&str> = self
            .params
            .iter()
            .filter(|p| !weights.contains_key(&p.name) && !self.bookkeeping.contains(&p.name))
            .map(|p| p.name.as_str())
            .collect();
        let unexpected: Vec<&str> = weights
            .keys()
            .filter(|k| !self.index.contains_key(*k) && !self.bookkeeping.contains(*k))
            .map(|k| k.as_str())
            .collect();
        let misshaped: Vec<String> = self
            .params
            .iter()
            .filter_map(|p| {
                let w = weights.get(&p.name)?;
                (w.dims() != p.var.dims()).then(|| {
                    format!(
                        "`{}` is {:?} in the file but {:?} in the model",
                        p.name,
                        w.dims(),
                        p.var.dims()
                    )
                })
            })
            .collect();
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!("missing {}", list(&missing)));
        }
        if !unexpected.is_empty() {
            problems.push(format!("unexpected {}", list(&unexpected)));
        }
        problems.extend(misshaped);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// Up to eight names in backticks, then how many more: for messages.
pub(crate) fn list(names: &[&str]) -> String {
    const SHOWN: usize = 8;
    let mut s = names
        .iter()
        .take(SHOWN)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    s
}

/// Whether the layers under a name train, overriding the recipe: what
/// [`Model::set_trainable`](crate::Model::set_trainable) keeps.
///
/// A rule names a layer by its full dotted name (`layer4`, `layer4.1.conv2`) and covers that
/// layer and every layer inside it; the empty name covers the whole model.
///
/// ```
/// use kandle::params::TrainableRule;
///
/// let rule = TrainableRule::new("layer4", true);
/// assert!(rule.covers("layer4") && rule.covers("layer4.1.bn2"));
/// assert!(!rule.covers("layer40") && !rule.covers("layer3"));
/// assert!(TrainableRule::new("", false).covers("fc"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainableRule {
    /// The layer's full name; empty for the whole model.
    pub name: String,
    /// Whether its variables train.
    pub trainable: bool,
}

impl TrainableRule {
    /// Layers under `name` train (`true`) or are frozen.
    pub fn new(name: impl Into<String>, trainable: bool) -> Self {
        Self {
            name: name.into(),
            trainable,
        }
    }

    /// Whether the rule covers the layer (or variable) called `path`.
    pub fn covers(&self, path: &str) -> bool {
        self.name.is_empty()
            || path
                .strip_prefix(self.name.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    }
}

/// Creates variables while a recipe is built: it knows the device, the name scope, whether the
/// layer being built is trainable, the [`ComputePath`] the layers take, and holds the seeded
/// generator that makes initial values repeatable.
#[derive(Debug)]
pub struct BuildContext {
    device: Device,
    store: ParamStore,
    rng: StdRng,
    scope: Vec<String>,
    trainable: bool,
    /// Layers run as in inference even in training (Keras's `training=False`).
    inference: bool,
    /// Trainability set by layer name, overriding the recipe's: the last rule whose name is
    /// the layer's or one of its enclosing scopes' decides.
    rules: Vec<TrainableRule>,
    replica: Option<ReplicaHandle>,
    compute_path: ComputePath,
    /// The dtype convolutions and dense layers compute in (mixed precision).
    compute_dtype: DType,
    /// Variables start at zero rather than from their initialiser (a context that only works
    /// out shapes).
    zeros: bool,
}

impl BuildContext {
    /// A context that creates variables on `device`, initialised from `seed`.
    pub fn new(device: &Device, seed: u64) -> Self {
        Self {
            device: device.clone(),
            store: ParamStore::new(),
            rng: StdRng::seed_from_u64(seed),
            scope: Vec::new(),
            trainable: true,
            inference: false,
            rules: Vec::new(),
            replica: None,
            compute_path: ComputePath::Auto,
            compute_dtype: DType::F32,
            zeros: false,
        }
    }

    /// Variables start at zero, without drawing from their initialisers: for a context that
    /// only works out shapes.
    pub(crate) fn zero_initialised(mut self) -> Self {
        self.zeros = true;
        self
    }

    /// Builds layers for `path`: with [`ComputePath::DeviceGeneric`] they never call kandle's
    /// CPU kernels and compose candle's device-generic ops, as on a GPU. The default is
    /// [`ComputePath::Auto`].
    pub fn with_compute_path(mut self, path: ComputePath) -> Self {
        self.compute_path = path;
        self
    }

    /// The path the layers are built for (see [`Self::with_compute_path`]).
    pub fn compute_path(&self) -> ComputePath {
        self.compute_path
    }

    /// Builds convolutions and dense layers that compute in `dtype` (mixed precision; the
    /// default is `F32`), their variables staying `F32`. See
    /// [`DTypePolicy::compute_dtype_on`](crate::DTypePolicy::compute_dtype_on) for the dtype a
    /// policy gives a path and device.
    pub fn with_compute_dtype(mut self, dtype: DType) -> Self {
        self.compute_dtype = dtype;
        self
    }

    /// The dtype the layer being built computes in (see [`Self::with_compute_dtype`]).
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// Runs `f` with the compute dtype set to `dtype`: a layer's own policy, as Keras's
    /// `dtype=` argument.
    pub fn with_dtype<R>(&mut self, dtype: DType, f: impl FnOnce(&mut Self) -> R) -> R {
        let saved = self.compute_dtype;
        self.compute_dtype = dtype;
        let out = f(self);
        self.compute_dtype = saved;
        out
    }

    /// Builds as one replica of a group whose batch normalisation uses global batch statistics
    /// (`SyncBatchNorm`).
    pub fn with_replica_group(mut self, handle: ReplicaHandle) -> Self {
        self.replica = Some(handle);
        self
    }

    /// The replica group, when batch statistics are synchronised across replicas.
    pub fn replica_group(&self) -> Option<&ReplicaHandle> {
        self.replica.as_ref()
    }

    /// The device variables are created on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the layer being built is trainable: false inside a frozen layer, unless a rule
    /// of [`Self::with_trainable_rules`] names the layer or a scope around it.
    pub fn trainable(&self) -> bool {
        let path = self.path();
        self.rules
            .iter()
            .rev()
            .find(|rule| rule.covers(&path))
            .map_or(self.trainable, |rule| rule.trainable)
    }

    /// Whether the layer being built runs as in inference even while the model trains
    /// (Keras's `training=False`): inside an [`inference_mode`] wrapper, and always when the
    /// layer is frozen. A `BatchNormalization` in inference mode normalises with its moving
    /// statistics and leaves them as they are.
    ///
    /// [`inference_mode`]: crate::layers::LayerSpecExt::inference_mode
    pub fn inference(&self) -> bool {
        self.inference || !self.trainable()
    }

    /// Whether the layer being built is inside an [`inference_mode`] wrapper (Keras's
    /// `training=False` at the call), frozen or not: a `Dropout` there drops nothing, where a
    /// frozen one (Keras's `trainable = False` alone) still drops in training.
    ///
    /// [`inference_mode`]: crate::layers::LayerSpecExt::inference_mode
    pub fn in_inference_mode(&self) -> bool {
        self.inference
    }

    /// Builds with `rules` deciding trainability by layer name (see [`TrainableRule`]); each
    /// overrides the recipe's `.trainable(...)` for the layers it names, the last that names a
    /// layer deciding.
    pub fn with_trainable_rules(mut self, rules: &[TrainableRule]) -> Self {
        self.rules = rules.to_vec();
        self
    }

    /// The tensor a layer computes with for `var`: the variable itself when the layer is
    /// trainable; otherwise an alias of its storage that candle's autograd does not track, so
    /// that no gradient is computed for a frozen variable (nor, below the lowest trainable
    /// layer, for anything else). Both see every later assignment to the variable.
    pub fn tensor_of(&self, var: &Var) -> Tensor {
        match self.trainable() {
            true => var.as_tensor().clone(),
            false => var.as_tensor().detach(),
        }
    }

    /// The full name of the current scope, e.g. `inception_2.branch_3x3`.
    pub fn path(&self) -> String {
        self.scope.join(".")
    }

    /// The generator for anything random a layer needs at build time (e.g. a dropout seed).
    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    /// Runs `f` inside the child scope `name`.
    pub fn scoped<R>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R) -> R {
        self.scope.push(name.to_string());
        let out = f(self);
        self.scope.pop();
        out
    }

    /// Runs `f` with trainability set to `trainable && self.trainable()`.
    pub fn with_trainable<R>(&mut self, trainable: bool, f: impl FnOnce(&mut Self) -> R) -> R {
        let saved = self.trainable;
        self.trainable = saved && trainable;
        let out = f(self);
        self.trainable = saved;
        out
    }

    /// Runs `f` with layers built in inference mode (see [`Self::inference`]) when `inference`.
    pub fn with_inference<R>(&mut self, inference: bool, f: impl FnOnce(&mut Self) -> R) -> R {
        let saved = self.inference;
        self.inference = saved || inference;
        let out = f(self);
        self.inference = saved;
        out
    }

    /// Creates a variable named `<scope>.<name>`; it is trainable unless the layer is frozen.
    pub fn variable(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        let trainable = self.trainable();
        self.create(name, shape, init, trainable)
    }

    /// Creates a statistic the layer updates itself and the optimizer never touches, such as a
    /// moving average. In inference mode ([`Self::inference`]) the layer leaves it as it is, so
    /// it is a plain non-trainable variable ([`Param::statistic`] false): replicas need not
    /// average it, and a step does not touch it.
    pub fn non_trainable_variable(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
    ) -> Result<Var> {
        let var = self.new_var(shape, init)?;
        self.store.insert_param(Param {
            name: self.full_name(name),
            var: var.clone(),
            trainable: false,
            statistic: !self.inference(),
            generator: false,
        })?;
        Ok(var)
    }

    /// Adds the position of a random generator under `<scope>.<name>`: a variable (two `f32`
    /// values holding a 48-bit count exactly) that starts at 0, is saved with the weights and
    /// is not counted as a parameter ([`Param::generator`]).
    pub fn generator_position(&mut self, name: &str) -> Result<Var> {
        let var = Var::zeros(2, candle_core::DType::F32, &self.device)?;
        self.store.insert_param(Param {
            name: self.full_name(name),
            var: var.clone(),
            trainable: false,
            statistic: false,
            generator: true,
        })?;
        Ok(var)
    }

    /// Adds an existing variable (e.g. one made by a wrapped candle module) under `<scope>.<name>`.
    pub fn adopt(&mut self, name: &str, var: Var) -> Result<()> {
        let full = self.full_name(name);
        let trainable = self.trainable();
        self.store.insert(full, var, trainable)
    }

    fn create(&mut self, name: &str, shape: &[usize], init: Init, trainable: bool) -> Result<Var> {
        let var = self.new_var(shape, init)?;
        self.store
            .insert(self.full_name(name), var.clone(), trainable)?;
        Ok(var)
    }

    fn new_var(&mut self, shape: &[usize], init: Init) -> Result<Var> {
        if self.zeros {
            return Ok(Var::zeros(shape, DType::F32, &self.device)?);
        }
        let count = shape.iter().product();
        let values = init.sample(count, &mut self.rng);
        let tensor = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(&self.device)?;
        Ok(Var::from_tensor(&tensor)?)
    }

    fn full_name(&self, name: &str) -> String {
        if self.scope.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path())
        }
    }

    /// `(trainable, non_trainable)` element counts of the variables under the child scope `name`.
    pub fn count_in(&self, name: &str) -> (usize, usize) {
        self.store.count(&format!("{}.", self.full_name(name)))
    }

    /// Creates the variables of the layers built from now on on `device`: a pipeline builds
    /// each stage of one recipe on its own device, drawing initial values from the one
    /// generator, so every variable starts as it would on a single device.
    pub(crate) fn move_to(&mut self, device: &Device) {
        self.device = device.clone();
    }

    /// Hands over the variables created so far and goes on with an empty store: the variables
    /// of one pipeline stage.
    pub(crate) fn take_store(&mut self) -> ParamStore {
        std::mem::take(&mut self.store)
    }

    /// Ends the build and hands over the variables.
    pub fn into_store(self) -> ParamStore {
        self.store
    }

    /// The variables created so far.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_values_and_names_are_scoped() -> Result<()> {
        let build = |seed| -> Result<(String, Vec<f32>)> {
            let mut ctx = BuildContext::new(&Device::Cpu, seed);
            let var = ctx.scoped("dense_1", |ctx| {
                ctx.variable(
                    "weight",
                    &[3, 4],
                    Init::GlorotUniform {
                        fan_in: 4,
                        fan_out: 3,
                    },
                )
            })?;
            let store = ctx.into_store();
            let name = store
                .iter()
                .next()
                .map(|p| p.name.clone())
                .unwrap_or_default();
            Ok((name, var.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        };
        let (name, a) = build(7)?;
        let (_, b) = build(7)?;
        let (_, c) = build(8)?;
        assert_eq!(name, "dense_1.weight");
        assert_eq!(a, b);
        assert_ne!(a, c);
        let limit = (6.0f32 / 7.0).sqrt();
        assert!(a.iter().all(|v| v.abs() <= limit));
        Ok(())
    }

    #[test]
    fn assign_reports_every_mismatch_and_changes_nothing() -> Result<()> {
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        ctx.variable("a", &[2], Init::Zeros)?;
        ctx.variable("b", &[3], Init::Zeros)?;
        let store = ctx.into_store();
        let mut w = Weights::new();
        w.insert("a".into(), Tensor::ones(3, DType::F32, &Device::Cpu)?);
        w.insert("c".into(), Tensor::ones(1, DType::F32, &Device::Cpu)?);
        let err = store
            .assign(&w)
            .expect_err("mismatch must fail")
            .to_string();
        assert!(err.contains("missing `b`"), "{err}");
        assert!(err.contains("unexpected `c`"), "{err}");
        assert!(err.contains("`a` is [3]"), "{err}");
        let a = store.get("a").map(|p| p.var.as_tensor().to_vec1::<f32>());
        assert_eq!(a.transpose()?, Some(vec![0.0, 0.0]));
        Ok(())
    }
}
