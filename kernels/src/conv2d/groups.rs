//! How a batch splits into groups of images over the pool's threads.
//!
//! A pass hands each group of images to one task, so the slowest thread ends the pass: three
//! groups of six images over two threads leave one thread idle for a third of the time. Where
//! the side-by-side GEMMs would like groups of some size (to fill their columns), they take the
//! size near that whose groups, dealt out a round of one per thread, leave the fewest images on
//! the busiest thread. (Winograd's groups do not: their size sets a block's width, and an
//! image's bits would then change with the batch.)

/// Images per group for `n` images over `threads` threads, at most `wanted` (and no more than
/// an even share, `n / threads` rounded up), at least half of it: the size whose groups, a
/// round of one per thread, put the fewest images on the busiest thread; the larger on a tie.
///
/// Sixteen images over two threads wanting six: groups of four (four groups, two rounds, eight
/// images a thread) rather than six (three groups: twelve images on one thread).
pub(crate) fn balanced_group(n: usize, wanted: usize, threads: usize) -> usize {
    let (n, threads) = (n.max(1), threads.max(1));
    let wanted = wanted.min(n.div_ceil(threads)).max(1);
    // Whole rounds of groups, each as large as the group: the busiest thread's images.
    let busiest = |g: usize| n.div_ceil(g).div_ceil(threads) * g;
    (wanted.div_ceil(2)..=wanted)
        .rev()
        .min_by_key(|&g| busiest(g))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_fill_whole_rounds_of_threads() {
        // (n, wanted, threads, group)
        for (n, wanted, threads, group) in [
            (16, 6, 2, 4),
            (64, 6, 2, 4),
            (64, 16, 2, 16),
            (16, 8, 2, 8),
            (64, 64, 2, 32),
            (7, 3, 2, 2),
            (1, 6, 2, 1),
            (5, 1, 16, 1),
            (12, 6, 1, 6),
            (0, 4, 2, 1),
        ] {
            assert_eq!(
                balanced_group(n, wanted, threads),
                group,
                "{n} images wanting {wanted} over {threads} threads"
            );
        }
    }
}
