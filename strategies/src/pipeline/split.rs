//! Where a pipeline cuts its model into stages: at layers the user names, or balanced by
//! parameter count or by each layer's measured time.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use kandle::layers::{Summary, SummaryRow};
use kandle::strategy::{ModelSpec, Replica, StagePlacement};
use kandle::{Error, Result};

/// Where a pipeline cuts its model into stages.
///
/// ```
/// use kandle_strategies::pipeline::{Balance, StageSplit};
///
/// let by_name = StageSplit::at(["conv2d_3", "dense_1"]); // three stages
/// assert_eq!(StageSplit::default(), StageSplit::Balanced(Balance::Time));
/// # let _ = by_name;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageSplit {
    /// Each named top-level layer starts a stage after the first: `S - 1` names for `S`
    /// stages, in the model's order.
    At(Vec<String>),
    /// Cut where the stages' costs are most even (the largest stage cost as small as it can
    /// be), every stage holding a layer with variables.
    Balanced(Balance),
}

impl Default for StageSplit {
    fn default() -> Self {
        StageSplit::Balanced(Balance::Time)
    }
}

impl StageSplit {
    /// A split at the named layers (each starts a stage after the first).
    pub fn at<S: Into<String>>(layers: impl IntoIterator<Item = S>) -> Self {
        StageSplit::At(layers.into_iter().map(Into::into).collect())
    }
}

/// What a balanced split evens out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Parameters (trainable and not): memory for weights and optimizer state.
    Parameters,
    /// Each layer's forward and backward time, measured once on the first stage's device on
    /// a probe micro-batch when the model is built: the pipeline's speed.
    Time,
}

/// The samples of the micro-batch each layer's time is measured on.
const PROBE_SAMPLES: usize = 16;

/// The stages of `spec`'s model (a `Sequential`, or a functional model of one input and one
/// output) on `devices`, one each, cut as `split` says. Returns the placements and the whole
/// model's summary.
pub(crate) fn placements(
    spec: &ModelSpec,
    devices: &[Device],
    split: &StageSplit,
) -> Result<(Vec<StagePlacement>, Summary)> {
    let [shape] = &spec.input_shapes[..] else {
        return Err(Error::invalid(format!(
            "a pipeline cuts a model of one input into stages, and this one has {}",
            spec.input_shapes.len()
        )));
    };
    let whole = spec.network.summary(shape)?;
    let rows = spec.network.stage_layers(&spec.input_shapes)?;
    let allowed = spec.network.stage_starts_allowed(&spec.input_shapes)?;
    let stages = devices.len();
    if stages > rows.len() {
        return Err(Error::invalid(format!(
            "a pipeline of {stages} stages needs at least as many layers, and the model has {}",
            rows.len()
        )));
    }
    let starts = match split {
        StageSplit::At(names) => named_starts(names, &rows, &allowed, stages)?,
        StageSplit::Balanced(balance) => {
            let costs = match balance {
                Balance::Parameters => rows
                    .iter()
                    .map(|r| (r.trainable + r.non_trainable) as f64)
                    .collect(),
                Balance::Time => segment_times(spec, &devices[0], &allowed)?,
            };
            let holds: Vec<bool> = rows.iter().map(has_variables).collect();
            balanced_starts(&costs, &holds, &allowed, stages)?
        }
    };
    check_variables(&starts, &rows)?;
    let placements = starts
        .into_iter()
        .zip(devices)
        .map(|(first_layer, device)| StagePlacement {
            first_layer,
            device: device.clone(),
        })
        .collect();
    Ok((placements, whole))
}

fn has_variables(row: &SummaryRow) -> bool {
    row.trainable + row.non_trainable > 0
}

/// The first layer of each stage when `names` start the stages after the first; a stage may
/// start only at a layer `allowed` says.
fn named_starts(
    names: &[String],
    rows: &[SummaryRow],
    allowed: &[bool],
    stages: usize,
) -> Result<Vec<usize>> {
    if names.len() + 1 != stages {
        return Err(Error::invalid(format!(
            "a pipeline of {stages} stages is cut at {} layers, and {} were named ({})",
            stages - 1,
            names.len(),
            names.join(", ")
        )));
    }
    let mut starts = vec![0];
    for name in names {
        let Some(at) = rows.iter().position(|r| r.name == *name) else {
            let all: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "the pipeline's stage split names `{name}`, which is not a top-level layer of \
                 the model; its layers are {}",
                all.join(", ")
            )));
        };
        if !allowed.get(at).copied().unwrap_or(false) {
            let allowed: Vec<&str> = rows
                .iter()
                .zip(allowed)
                .skip(1)
                .filter(|(_, &a)| a)
                .map(|(r, _)| r.name.as_str())
                .collect();
            return Err(Error::invalid(format!(
                "a pipeline stage cannot start at `{name}`: more than one tensor flows past it \
                 (inside a residual block, say); stages may start at {}",
                allowed.join(", ")
            )));
        }
        if at <= *starts.last().unwrap_or(&0) {
            return Err(Error::invalid(format!(
                "the pipeline's stage split names `{name}` out of order (or the first layer, \
                 which starts stage 0): name the layers that start stages 1 to {} in the \
                 model's order",
                stages - 1
            )));
        }
        starts.push(at);
    }
    Ok(starts)
}

/// An error naming the first stage without variables, which would have nothing to train.
fn check_variables(starts: &[usize], rows: &[SummaryRow]) -> Result<()> {
    for (s, &first) in starts.iter().enumerate() {
        let end = starts.get(s + 1).copied().unwrap_or(rows.len());
        let stage = &rows[first..end];
        if !stage.iter().any(has_variables) {
            let names: Vec<&str> = stage.iter().map(|r| r.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "pipeline stage {s} ({}) has no variables: start the stages at other layers, or \
                 use fewer stages",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

/// Cuts layers of `costs` into `stages` consecutive runs, each starting at a layer `allowed`
/// says and holding a layer that `holds` variables, so that the costliest run costs as little
/// as it can; returns each run's first layer.
fn balanced_starts(
    costs: &[f64],
    holds: &[bool],
    allowed: &[bool],
    stages: usize,
) -> Result<Vec<usize>> {
    let n = costs.len();
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |sum, c| {
            *sum += c;
            Some(*sum)
        }))
        .collect();
    let held: Vec<usize> = std::iter::once(0)
        .chain(holds.iter().scan(0, |sum, &h| {
            *sum += usize::from(h);
            Some(*sum)
        }))
        .collect();
    // best[k][i]: the least largest cost of cutting the first i layers into k runs, and
    // where the last run starts.
    let mut best = vec![vec![(f64::INFINITY, 0usize); n + 1]; stages + 1];
    best[0][0] = (0.0, 0);
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                let before = best[k - 1][j].0;
                if !before.is_finite() || held[i] == held[j] || !allowed[j] {
                    continue;
                }
                let worst = before.max(prefix[i] - prefix[j]);
                if worst < best[k][i].0 {
                    best[k][i] = (worst, j);
                }
            }
        }
    }
    if !best[stages][n].0.is_finite() {
        return Err(Error::invalid(format!(
            "the model cannot be cut into {stages} stages that each hold a layer with \
             variables and start where one tensor flows: use fewer stages"
        )));
    }
    let mut starts = vec![0; stages];
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = best[k][end].1;
        starts[k - 1] = start;
        end = start;
    }
    Ok(starts)
}

/// The forward and backward time on `device`, on a probe micro-batch, of each run of layers
/// from one layer `allowed` to start a stage to the next (given to the run's first layer; the
/// others cost nothing): the model built with every such run a stage of its own, each run
/// twice and the faster kept.
fn segment_times(spec: &ModelSpec, device: &Device, allowed: &[bool]) -> Result<Vec<f64>> {
    let starts: Vec<usize> = (0..allowed.len()).filter(|&i| allowed[i]).collect();
    let each: Vec<StagePlacement> = starts
        .iter()
        .map(|&first_layer| StagePlacement {
            first_layer,
            device: device.clone(),
        })
        .collect();
    let stages = Replica::stages(spec, &each)?;
    let mut shape = vec![PROBE_SAMPLES];
    shape.extend(&spec.input_shapes[0]);
    let mut x = Tensor::randn(0f32, 1.0, shape, device)?;
    let mut times = vec![0.0; allowed.len()];
    for (stage, &first) in stages.iter().zip(&starts) {
        let mut fastest = f64::INFINITY;
        let mut output = None;
        for _ in 0..2 {
            let mut step = stage.begin_stage_step()?;
            let start = Instant::now();
            let y = step.forward(0, &x)?;
            let dx = step.backward(0, &y.ones_like()?)?;
            // The time includes the device's queue (a GPU's kernels run asynchronously).
            if let Some(dx) = dx {
                dx.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
            }
            fastest = fastest.min(start.elapsed().as_secs_f64());
            output = Some(y);
        }
        x = output.ok_or_else(|| Error::invalid("a layer without output"))?;
        times[first] = fastest;
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_cuts_even_out_the_largest_stage() -> Result<()> {
        let costs = [1.0, 1.0, 1.0, 1.0, 4.0, 0.0];
        let (holds, anywhere) = ([true; 6], [true; 6]);
        assert_eq!(balanced_starts(&costs, &holds, &anywhere, 2)?, vec![0, 4]);
        assert_eq!(
            balanced_starts(&costs, &holds, &anywhere, 3)?,
            vec![0, 2, 4]
        );
        // A stage of the one variable-free layer is no stage.
        let holds = [true, true, true, true, true, false];
        assert_eq!(
            balanced_starts(&costs, &holds, &anywhere, 3)?,
            vec![0, 2, 4]
        );
        let err = balanced_starts(
            &costs,
            &[false, false, false, false, true, false],
            &anywhere,
            2,
        );
        assert!(err.is_err());
        // Stages start only where allowed (where one tensor flows).
        let allowed = [true, false, false, true, false, false];
        assert_eq!(
            balanced_starts(&costs, &[true; 6], &allowed, 2)?,
            vec![0, 3]
        );
        Ok(())
    }
}
