//! The greedy partitioner that places variables on parameter servers (the
//! `ParameterServerStrategy` of the `mpi` feature): each variable whole,
//! largest first, on the server that holds the fewest values so far (TensorFlow's
//! `MinSizePartitioner` idea, applied to whole variables as its `ps_strategy` greedy placement
//! does).

use kandle::{Error, Result};

/// Assigns each of `sizes` (the variables' element counts) to one of `servers` servers,
/// balancing the values each holds: variables are taken largest first (ties in their order)
/// and each goes to the server with the fewest values so far (ties to the lowest index).
/// Returns the server of each variable, in the order of `sizes`.
///
/// Fails with no server, or with more servers than variables (a server would hold nothing).
pub fn partition(sizes: &[usize], servers: usize) -> Result<Vec<usize>> {
    if servers == 0 {
        return Err(Error::invalid(
            "parameter servers: need at least one server",
        ));
    }
    if servers > sizes.len() {
        return Err(Error::invalid(format!(
            "{servers} parameter servers for a model of {} variable(s): each variable lives \
             whole on one server, so a server would hold nothing; use at most {} server(s)",
            sizes.len(),
            sizes.len()
        )));
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    // Stable: equal sizes keep their order, so every process computes the same placement.
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
    let mut load = vec![0usize; servers];
    let mut placed = vec![0usize; sizes.len()];
    for v in order {
        let (server, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(s, &l)| (l, s))
            .ok_or_else(|| Error::invalid("parameter servers: need at least one server"))?;
        placed[v] = server;
        load[server] += sizes[v];
    }
    Ok(placed)
}

/// The values each of `servers` servers holds under `placement` (from [`partition`]).
pub fn server_loads(sizes: &[usize], placement: &[usize], servers: usize) -> Vec<usize> {
    let mut load = vec![0; servers];
    for (&size, &server) in sizes.iter().zip(placement) {
        if let Some(l) = load.get_mut(server) {
            *l += size;
        }
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_first_on_the_least_loaded_server() -> Result<()> {
        let sizes = [10, 40, 30, 20, 5];
        let placed = partition(&sizes, 2)?;
        // 40 -> 0, 30 -> 1, 20 -> 1, 10 -> 0, 5 -> 0 (0: 55, 1: 50).
        assert_eq!(placed, vec![0, 0, 1, 1, 0]);
        assert_eq!(server_loads(&sizes, &placed, 2), vec![55, 50]);
        Ok(())
    }

    #[test]
    fn one_server_holds_everything_and_every_server_gets_one() -> Result<()> {
        assert_eq!(partition(&[3, 1, 2], 1)?, vec![0, 0, 0]);
        let placed = partition(&[3, 1, 2], 3)?;
        let mut servers = placed.clone();
        servers.sort_unstable();
        assert_eq!(servers, vec![0, 1, 2]);
        Ok(())
    }

    #[test]
    fn the_imbalance_is_at_most_the_largest_variable() -> Result<()> {
        // Many sizes, as a network has: the greedy placement's spread stays below the largest.
        let sizes: Vec<usize> = (1..200).map(|i| (i * 7919) % 1000 + 1).collect();
        for servers in 1..=5 {
            let loads = server_loads(&sizes, &partition(&sizes, servers)?, servers);
            let spread = loads.iter().max().unwrap_or(&0) - loads.iter().min().unwrap_or(&0);
            assert!(spread <= 1000, "{servers} servers: {loads:?}");
            assert_eq!(loads.iter().sum::<usize>(), sizes.iter().sum::<usize>());
        }
        Ok(())
    }

    #[test]
    fn more_servers_than_variables_is_an_error() {
        let e = match partition(&[1, 2], 3) {
            Err(e) => e.to_string(),
            Ok(placed) => panic!("3 servers for 2 variables placed them: {placed:?}"),
        };
        assert!(
            e.contains("3 parameter servers for a model of 2 variable(s)"),
            "{e}"
        );
        assert!(partition(&[1], 0).is_err());
    }
}
