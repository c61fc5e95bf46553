//! How a dataset's inputs feed a model's: by name when the dataset names them (Keras's dict of
//! inputs), else in the model's order; each checked against the input it feeds, so swapped,
//! missing, extra or reshaped parts are errors that name the input and both shapes.

use crate::data::{list_inputs, InputSpec};
use crate::network::{input_shape_error, NetworkInput};
use crate::{Error, Result};

/// Which of `given` (a dataset's inputs, named `data`) feeds each of `model`'s inputs: `None`
/// when they come in the model's order, else the dataset input of each model input. A model
/// that declares no input (a `Sequential` without `input_shape`) takes one input of any shape
/// and name.
pub(crate) fn match_inputs(
    model: &[NetworkInput],
    given: &[InputSpec],
    data: &str,
) -> Result<Option<Vec<usize>>> {
    if model.is_empty() {
        return match given {
            [_] => Ok(None),
            _ => Err(Error::invalid(format!(
                "the model takes one input, but `{data}` has {}: {}",
                given.len(),
                list_inputs(given)
            ))),
        };
    }
    let names: Vec<&str> = model.iter().map(|i| i.name.as_str()).collect();
    let named = given.iter().filter(|g| g.name.is_some()).count();
    let order = match named {
        0 => {
            if given.len() != model.len() {
                return Err(Error::invalid(format!(
                    "the model takes {} input(s) ({}), but `{data}` has {}: {}",
                    model.len(),
                    quoted(&names),
                    given.len(),
                    list_inputs(given)
                )));
            }
            (0..model.len()).collect::<Vec<_>>()
        }
        n if n == given.len() => by_name(model, given, data)?,
        _ => {
            return Err(Error::invalid(format!(
                "`{data}` names some of its inputs and not others ({}); name all of them or none",
                list_inputs(given)
            )))
        }
    };
    for (input, &i) in model.iter().zip(&order) {
        if !input.takes(&given[i].shape) {
            return Err(input_shape_error(
                &input.name,
                &input.shape,
                &given[i].shape,
                data,
            ));
        }
    }
    let in_order = order.iter().enumerate().all(|(i, &o)| i == o);
    Ok((!in_order).then_some(order))
}

/// The dataset input named after each model input.
fn by_name(model: &[NetworkInput], given: &[InputSpec], data: &str) -> Result<Vec<usize>> {
    let names: Vec<&str> = model.iter().map(|i| i.name.as_str()).collect();
    if let Some(extra) = given
        .iter()
        .find(|g| !names.contains(&g.name.as_deref().unwrap_or_default()))
    {
        return Err(Error::invalid(format!(
            "`{data}` has input {extra}, which the model does not take: its inputs are {}",
            quoted(&names)
        )));
    }
    model
        .iter()
        .map(|input| {
            given
                .iter()
                .position(|g| g.name.as_deref() == Some(input.name.as_str()))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "`{data}` has no input `{}` {}: its inputs are {}",
                        input.name,
                        crate::error::shape_with_batch(&input.shape),
                        list_inputs(given)
                    ))
                })
        })
        .collect()
}

fn quoted(names: &[&str]) -> String {
    let each: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    each.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Vec<NetworkInput> {
        vec![
            NetworkInput {
                name: "image".into(),
                shape: vec![1, 8, 8],
                any_size: false,
            },
            NetworkInput {
                name: "features".into(),
                shape: vec![5],
                any_size: false,
            },
        ]
    }

    #[test]
    fn parts_in_order_or_by_name() -> Result<()> {
        let image = InputSpec::new(&[1, 8, 8]);
        let features = InputSpec::new(&[5]);
        assert_eq!(
            match_inputs(&model(), &[image.clone(), features.clone()], "d")?,
            None
        );
        let named = [features.named("features"), image.named("image")];
        assert_eq!(match_inputs(&model(), &named, "d")?, Some(vec![1, 0]));
        Ok(())
    }

    #[test]
    fn swapped_missing_extra_and_reshaped_parts_name_the_input() {
        let err = |given: &[InputSpec]| match match_inputs(&model(), given, "d") {
            Ok(order) => panic!("accepted {given:?} as {order:?}"),
            Err(e) => e.to_string(),
        };
        let swapped = err(&[InputSpec::new(&[5]), InputSpec::new(&[1, 8, 8])]);
        assert!(swapped.contains("`image`"), "{swapped}");
        assert!(swapped.contains("(batch, 1, 8, 8)") && swapped.contains("(batch, 5)"));
        let flat = err(&[InputSpec::new(&[64]), InputSpec::new(&[5])]);
        assert!(
            flat.contains("`image`") && flat.contains("(batch, 64)"),
            "{flat}"
        );
        let missing = err(&[InputSpec::new(&[1, 8, 8]).named("image")]);
        assert!(missing.contains("no input `features`"), "{missing}");
        let extra = err(&[
            InputSpec::new(&[1, 8, 8]).named("image"),
            InputSpec::new(&[5]).named("features"),
            InputSpec::new(&[2]).named("mask"),
        ]);
        assert!(
            extra.contains("`mask`") && extra.contains("does not take"),
            "{extra}"
        );
        let count = err(&[InputSpec::new(&[1, 8, 8])]);
        assert!(count.contains("takes 2 input(s)"), "{count}");
    }
}
