//! The cuDNN convolutions of `kandle_kernels::cuda` on a GPU, against the CPU kernels
//! (`kandle_kernels::conv2d` and its backward pass) and a float64 reference written out below:
//! forward, input and kernel gradients for MiniGoogLeNet-like shapes (3x3 at strides 1 and 2,
//! 1x1, 5x5, padding on one side, batches of 1 and 8), grouped and dilated convolutions, `f64`,
//! `f16` and `bf16`; the algorithm cache (one search per shape); deterministic algorithms (the
//! same bits twice); and errors for inputs the ops cannot take.
//!
//! Built with the `cudnn` feature only. Every test returns early, saying so, where no CUDA
//! device is present. The tests take one lock, so they run one at a time: they share the
//! device, and the cache test counts searches from a cleared cache.

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use kandle_kernels::conv2d::{conv2d as cpu_conv2d, conv2d_backward};
use kandle_kernels::cuda::{self, AlgoSearch, Algorithms, Conv2dParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The GPU, once per process, and the lock every test holds while it uses it; `None` (and a
/// note) where there is no CUDA device.
fn gpu() -> Option<(Device, MutexGuard<'static, ()>)> {
    static DEVICE: OnceLock<Option<Device>> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let device = DEVICE.get_or_init(|| match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            // The first line: candle's errors may carry a backtrace.
            let e = e.to_string();
            let e = e.lines().next().unwrap_or_default();
            eprintln!("no CUDA device ({e}): the cuDNN convolution tests return early");
            None
        }
    });
    let guard = LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    device.clone().map(|d| (d, guard))
}

/// `len` values uniform in [-1, 1), from `seed`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1f32..1f32)).collect()
}

/// A CPU tensor of `dims` with [`values`].
fn tensor(dims: [usize; 4], seed: u64) -> Result<Tensor> {
    Ok(Tensor::from_vec(
        values(dims.iter().product(), seed),
        dims.to_vec(),
        &Device::Cpu,
    )?)
}

/// A tensor's values as `f64`, read back from wherever it is.
fn host(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?)
}

/// The largest difference between `got` and `want`, relative to `want`'s largest magnitude.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
    diff / scale
}

/// Checks `got` against `want` within `tol`, relative to `want`'s largest magnitude.
fn assert_close(what: &str, got: &Tensor, want: &[f64], tol: f64) -> Result<()> {
    let err = relative_error(&host(got)?, want);
    assert!(err <= tol, "{what}: relative error {err:.3e} > {tol:.0e}");
    Ok(())
}

/// A convolution's shapes and window, for the float64 reference.
#[derive(Debug, Clone, Copy)]
struct Case {
    x: [usize; 4],
    o: usize,
    k: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
    dilation: (usize, usize),
    groups: usize,
}

impl Case {
    fn new(x: [usize; 4], o: usize, k: usize, stride: usize, pad: usize) -> Self {
        Self {
            x,
            o,
            k: (k, k),
            stride: (stride, stride),
            padding: (pad, pad, pad, pad),
            dilation: (1, 1),
            groups: 1,
        }
    }

    fn w(&self) -> [usize; 4] {
        [self.o, self.x[1] / self.groups, self.k.0, self.k.1]
    }

    fn y(&self) -> [usize; 4] {
        let [n, _, h, w] = self.x;
        let (t, b, l, r) = self.padding;
        let eh = self.dilation.0 * (self.k.0 - 1) + 1;
        let ew = self.dilation.1 * (self.k.1 - 1) + 1;
        [
            n,
            self.o,
            (h + t + b - eh) / self.stride.0 + 1,
            (w + l + r - ew) / self.stride.1 + 1,
        ]
    }

    fn params(&self, algorithms: Algorithms) -> Conv2dParams {
        Conv2dParams {
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            groups: self.groups,
            algorithms,
        }
    }

    /// Calls `f(xi, wi, yi)` for every product `x[xi] * w[wi]` that output `y[yi]` sums.
    fn for_each_product(&self, mut f: impl FnMut(usize, usize, usize)) {
        let [n, c, h, w] = self.x;
        let [o, cg, kh, kw] = self.w();
        let [_, _, ho, wo] = self.y();
        let og = o / self.groups;
        for b in 0..n {
            for oc in 0..o {
                let g = oc / og;
                for ci in 0..cg {
                    let ic = g * cg + ci;
                    for oy in 0..ho {
                        for ox in 0..wo {
                            let yi = ((b * o + oc) * ho + oy) * wo + ox;
                            for ky in 0..kh {
                                let iy = oy * self.stride.0 + ky * self.dilation.0;
                                let Some(iy) = iy.checked_sub(self.padding.0).filter(|&v| v < h)
                                else {
                                    continue;
                                };
                                for kx in 0..kw {
                                    let ix = ox * self.stride.1 + kx * self.dilation.1;
                                    let Some(ix) =
                                        ix.checked_sub(self.padding.2).filter(|&v| v < w)
                                    else {
                                        continue;
                                    };
                                    let xi = ((b * c + ic) * h + iy) * w + ix;
                                    let wi = ((oc * cg + ci) * kh + ky) * kw + kx;
                                    f(xi, wi, yi);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The float64 forward pass, input gradient and kernel gradient.
    fn reference(&self, x: &[f64], w: &[f64], dy: &[f64]) -> [Vec<f64>; 3] {
        let mut y = vec![0.0; self.y().iter().product()];
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; w.len()];
        self.for_each_product(|xi, wi, yi| {
            y[yi] += x[xi] * w[wi];
            dx[xi] += dy[yi] * w[wi];
            dw[wi] += x[xi] * dy[yi];
        });
        [y, dx, dw]
    }
}

/// The three cuDNN operations of `case` on `gpu`, from CPU tensors, in `dtype`.
fn on_gpu(
    case: &Case,
    (x, w, dy): (&Tensor, &Tensor, &Tensor),
    gpu: &Device,
    dtype: DType,
    algorithms: Algorithms,
) -> Result<[Tensor; 3]> {
    let to = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(gpu)?) };
    let (x, w, dy) = (to(x)?, to(w)?, to(dy)?);
    let params = case.params(algorithms);
    let y = cuda::conv2d(&x, &w, params)?;
    let dx = cuda::conv2d_input_grad(&dy, &w, x.dims(), params)?;
    let dw = cuda::conv2d_kernel_grad(&x, &dy, w.dims(), params)?;
    for (t, dims) in [(&y, case.y()), (&dx, case.x), (&dw, case.w())] {
        assert_eq!(t.dims(), dims, "{case:?}");
        assert_eq!(t.dtype(), dtype, "{case:?}");
    }
    Ok([y, dx, dw])
}

/// Both ways of choosing an algorithm.
fn searches() -> [Algorithms; 2] {
    [AlgoSearch::Benchmark, AlgoSearch::Heuristic].map(|search| Algorithms {
        search,
        ..Default::default()
    })
}

#[test]
fn matches_the_cpu_kernels_on_mini_googlenet_shapes() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    let cases = [
        // The first layer: 3 channels, batch 1.
        Case::new([1, 3, 32, 32], 96, 3, 1, 1),
        // Inception 1x1 and 3x3 branches.
        Case::new([8, 96, 32, 32], 32, 1, 1, 0),
        Case::new([8, 96, 32, 32], 32, 3, 1, 1),
        Case::new([8, 160, 15, 15], 80, 3, 1, 1),
        Case::new([8, 336, 7, 7], 160, 3, 1, 1),
        // Downsample: 3x3 at stride 2, unpadded.
        Case::new([8, 80, 32, 32], 80, 3, 2, 0),
        // 5x5 with padding 2, and 3x3 at stride 2 padded on one side only (Keras's "same").
        Case::new([8, 16, 14, 14], 24, 5, 1, 2),
        Case {
            padding: (0, 1, 0, 1),
            ..Case::new([2, 24, 8, 8], 16, 3, 2, 0)
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let seed = 10 * i as u64;
        let (x, w, dy) = (
            tensor(case.x, seed)?,
            tensor(case.w(), seed + 1)?,
            tensor(case.y(), seed + 2)?,
        );
        let want_y = host(&cpu_conv2d(&x, &w, None, case.stride, case.padding)?)?;
        let grads = conv2d_backward(
            &x,
            &w,
            &dy,
            (true, true, false),
            case.stride,
            case.padding,
            None,
        )?;
        let (Some(want_dx), Some(want_dw)) = (grads.input, grads.weight) else {
            anyhow::bail!("the CPU backward pass returned no gradient");
        };
        let (want_dx, want_dw) = (host(&want_dx)?, host(&want_dw)?);
        for algorithms in searches() {
            let what = |op: &str| format!("{op} {case:?} {:?}", algorithms.search);
            let [y, dx, dw] = on_gpu(case, (&x, &w, &dy), &gpu, DType::F32, algorithms)?;
            assert_close(&what("forward"), &y, &want_y, 1e-4)?;
            assert_close(&what("input gradient"), &dx, &want_dx, 1e-4)?;
            assert_close(&what("kernel gradient"), &dw, &want_dw, 1e-4)?;
        }
    }
    Ok(())
}

#[test]
fn grouped_dilated_and_float64_convolutions_match_a_float64_reference() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    let cases = [
        Case {
            groups: 2,
            ..Case::new([2, 8, 9, 9], 6, 3, 1, 1)
        },
        Case {
            groups: 4,
            ..Case::new([3, 16, 10, 10], 8, 3, 2, 1)
        },
        Case {
            dilation: (2, 2),
            ..Case::new([2, 6, 11, 11], 5, 3, 1, 2)
        },
        Case {
            k: (3, 1),
            stride: (2, 1),
            padding: (1, 2, 0, 0),
            ..Case::new([2, 5, 9, 7], 4, 3, 1, 0)
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let (x, w, dy) = (
            tensor(case.x, seed)?,
            tensor(case.w(), seed + 1)?,
            tensor(case.y(), seed + 2)?,
        );
        let want = case.reference(&host(&x)?, &host(&w)?, &host(&dy)?);
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::F64, 1e-12)] {
            for algorithms in searches() {
                let got = on_gpu(case, (&x, &w, &dy), &gpu, dtype, algorithms)?;
                for ((op, got), want) in ["forward", "input gradient", "kernel gradient"]
                    .iter()
                    .zip(&got)
                    .zip(&want)
                {
                    let what = format!("{op} {case:?} {dtype:?} {:?}", algorithms.search);
                    assert_close(&what, got, want, tol)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_accumulates_in_float32() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    let case = Case::new([8, 64, 16, 16], 32, 3, 1, 1);
    // Rounded to each dtype first, so that the reference sees the same inputs: what is left is
    // the rounding of the outputs (2^-11 for f16, 2^-8 for bf16) and of any partial sums.
    for (dtype, tol) in [(DType::F16, 4e-3), (DType::BF16, 2e-2)] {
        let round = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?) };
        let x = round(tensor(case.x, 7)?)?;
        let w = round(tensor(case.w(), 8)?)?;
        let dy = round(tensor(case.y(), 9)?)?;
        let want = case.reference(&host(&x)?, &host(&w)?, &host(&dy)?);
        for algorithms in searches() {
            let got = on_gpu(&case, (&x, &w, &dy), &gpu, dtype, algorithms)?;
            for ((op, got), want) in ["forward", "input gradient", "kernel gradient"]
                .iter()
                .zip(&got)
                .zip(&want)
            {
                assert_close(
                    &format!("{op} {dtype:?} {:?}", algorithms.search),
                    got,
                    want,
                    tol,
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn autograd_runs_the_gradient_ops() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    let case = Case::new([4, 32, 16, 16], 48, 3, 2, 1);
    let x = Var::from_tensor(&tensor(case.x, 21)?.to_device(&gpu)?)?;
    let w = Var::from_tensor(&tensor(case.w(), 22)?.to_device(&gpu)?)?;
    let dy = tensor(case.y(), 23)?.to_device(&gpu)?;
    let params = case.params(Algorithms::default());
    let y = cuda::conv2d(x.as_tensor(), w.as_tensor(), params)?;
    let grads = (y * &dy)?.sum_all()?.backward()?;
    let (Some(gx), Some(gw)) = (grads.get(x.as_tensor()), grads.get(w.as_tensor())) else {
        anyhow::bail!("autograd returned no gradient for the input or the kernel");
    };
    let dx = cuda::conv2d_input_grad(&dy, w.as_tensor(), case.x.as_slice(), params)?;
    let dw = cuda::conv2d_kernel_grad(x.as_tensor(), &dy, case.w().as_slice(), params)?;
    assert_close("autograd's input gradient", gx, &host(&dx)?, 1e-5)?;
    assert_close("autograd's kernel gradient", gw, &host(&dw)?, 1e-5)?;
    Ok(())
}

#[test]
fn an_algorithm_is_searched_once_per_shape() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    cuda::clear_caches();
    assert_eq!(cuda::cache_stats(&gpu)?, cuda::CacheStats::default());
    let case = Case::new([8, 32, 16, 16], 64, 3, 1, 1);
    let x = tensor(case.x, 31)?.to_device(&gpu)?;
    let w = tensor(case.w(), 32)?.to_device(&gpu)?;
    let params = case.params(Algorithms::default());
    let y = cuda::conv2d(&x, &w, params)?;
    let first = cuda::cache_stats(&gpu)?;
    assert_eq!(
        (first.searches, first.hits, first.plans),
        (1, 0, 1),
        "{first:?}"
    );
    let again = cuda::conv2d(&x, &w, params)?;
    let second = cuda::cache_stats(&gpu)?;
    assert_eq!(
        (second.searches, second.hits, second.plans),
        (1, 1, 1),
        "{second:?}"
    );
    assert!(second.workspace_bytes >= first.workspace_bytes);
    assert_eq!(relative_error(&host(&again)?, &host(&y)?), 0.0);
    // Another operation, stride, dtype or setting is another plan; the same again is not.
    let dy = y.ones_like()?;
    cuda::conv2d_input_grad(&dy, &w, x.dims(), params)?;
    cuda::conv2d_input_grad(&dy, &w, x.dims(), params)?;
    let strided = Conv2dParams {
        stride: (2, 2),
        ..params
    };
    cuda::conv2d(&x, &w, strided)?;
    cuda::conv2d(&x.to_dtype(DType::F16)?, &w.to_dtype(DType::F16)?, params)?;
    let heuristic = Conv2dParams {
        algorithms: Algorithms {
            search: AlgoSearch::Heuristic,
            ..params.algorithms
        },
        ..params
    };
    cuda::conv2d(&x, &w, heuristic)?;
    cuda::conv2d(&x, &w, heuristic)?;
    let last = cuda::cache_stats(&gpu)?;
    assert_eq!(
        (last.searches, last.hits, last.plans),
        (5, 3, 5),
        "{last:?}"
    );
    assert!(last.workspace_bytes >= second.workspace_bytes);
    println!("cache after 8 calls: {last:?}");
    Ok(())
}

#[test]
fn deterministic_algorithms_give_the_same_bits_twice() -> Result<()> {
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    // Gradients with many terms per value, where algorithms that add with atomics would differ.
    let case = Case::new([16, 64, 32, 32], 64, 3, 1, 1);
    let (x, w, dy) = (
        tensor(case.x, 41)?,
        tensor(case.w(), 42)?,
        tensor(case.y(), 43)?,
    );
    for search in [AlgoSearch::Benchmark, AlgoSearch::Heuristic] {
        let algorithms = Algorithms {
            search,
            deterministic: true,
            ..Default::default()
        };
        let first = on_gpu(&case, (&x, &w, &dy), &gpu, DType::F32, algorithms)?;
        let second = on_gpu(&case, (&x, &w, &dy), &gpu, DType::F32, algorithms)?;
        for ((op, a), b) in ["forward", "input gradient", "kernel gradient"]
            .iter()
            .zip(&first)
            .zip(&second)
        {
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect())
            };
            assert!(
                bits(a)? == bits(b)?,
                "{op} ({search:?}) differs between two calls"
            );
        }
    }
    Ok(())
}

#[test]
fn inputs_the_ops_cannot_take_are_errors() -> Result<()> {
    // On the CPU: an error naming the CPU kernel, with or without a GPU.
    let case = Case::new([2, 4, 8, 8], 6, 3, 1, 1);
    let (x, w) = (tensor(case.x, 51)?, tensor(case.w(), 52)?);
    let params = case.params(Algorithms::default());
    let err = cuda::conv2d(&x, &w, params).expect_err("CPU tensors");
    assert!(err.to_string().contains("CUDA device"), "{err}");
    let Some((gpu, _lock)) = gpu() else {
        return Ok(());
    };
    let (x, w) = (x.to_device(&gpu)?, w.to_device(&gpu)?);
    let dy = tensor(case.y(), 53)?.to_device(&gpu)?;
    let expect_err = |what: &str, r: kandle_kernels::Result<Tensor>, says: &str| match r {
        Ok(t) => panic!("{what}: expected an error, got a {:?} tensor", t.dims()),
        Err(e) => assert!(e.to_string().contains(says), "{what}: {e}"),
    };
    let three_channels = tensor([6, 3, 3, 3], 54)?.to_device(&gpu)?;
    expect_err(
        "channels",
        cuda::conv2d(&x, &three_channels, params),
        "group",
    );
    expect_err(
        "dtypes",
        cuda::conv2d(&x, &w.to_dtype(DType::F16)?, params),
        "dtype",
    );
    expect_err(
        "u8",
        cuda::conv2d(&x.to_dtype(DType::U8)?, &w.to_dtype(DType::U8)?, params),
        "dtype",
    );
    expect_err(
        "3-D",
        cuda::conv2d(&x.flatten(0, 1)?, &w, params),
        "4 dimensions",
    );
    let grouped = Conv2dParams {
        groups: 3,
        ..params
    };
    expect_err("groups", cuda::conv2d(&x, &w, grouped), "group");
    let unpadded = Conv2dParams {
        padding: (0, 0, 0, 0),
        ..params
    };
    let tiny = x.narrow(2, 0, 2)?;
    expect_err(
        "window",
        cuda::conv2d(&tiny, &w, unpadded),
        "smaller than the kernel",
    );
    expect_err(
        "output gradient",
        cuda::conv2d_input_grad(&dy.narrow(3, 0, 4)?, &w, x.dims(), params),
        "does not match",
    );
    expect_err(
        "kernel dims",
        cuda::conv2d_kernel_grad(&x, &dy, &[6, 4, 3], params),
        "4 dimensions",
    );
    let zero_stride = Conv2dParams {
        stride: (0, 1),
        ..params
    };
    expect_err("stride", cuda::conv2d(&x, &w, zero_stride), "non-zero");
    // A transposed (strided) input is made contiguous first, not refused.
    let xt = x.transpose(2, 3)?;
    let y = cuda::conv2d(&xt, &w, params)?;
    let want = cuda::conv2d(&xt.contiguous()?, &w, params)?;
    assert_eq!(relative_error(&host(&y)?, &host(&want)?), 0.0);
    Ok(())
}
