//! New output buffers, written plane by plane in parallel without being zeroed first.
//!
//! A kernel's output is as large as its input; `vec![0.0; len]` would zero all of it in one
//! more pass over memory (the allocator's `memset`) before the kernel writes it again, and
//! zeroing each plane just before writing it still costs a pass of stores that wait for
//! memory. Here the kernel writes each plane's values once, into uninitialised memory, through
//! [`Plane`]: its methods write every value of the plane, and only they make the [`Written`]
//! that the kernel must hand back for each plane. So every value is set before the buffer
//! becomes a `Vec`, and no uninitialised memory is ever read.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::planes::{for_each_plane, map_channels, ChannelPlanesMut};

/// One plane of a new output, not yet written.
pub(crate) struct Plane<'p> {
    slots: &'p mut [MaybeUninit<f32>],
}

/// Proof that a [`Plane`] of lifetime `'p` was written in full: only [`Plane`]'s methods make
/// one, and `'p` is invariant, so a kernel cannot hand back one made for another plane.
pub(crate) struct Written<'p>(PhantomData<fn(&'p ()) -> &'p ()>);

impl<'p> Plane<'p> {
    /// Writes `f(a[i], b[i])` to each value `i` of the plane and zero past the end of the
    /// shorter input (there is none when the inputs are as long as the plane).
    #[inline(always)]
    pub(crate) fn zip_with(self, a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> Written<'p> {
        let n = self.slots.len().min(a.len()).min(b.len());
        let (head, rest) = self.slots.split_at_mut(n);
        for ((o, &x), &y) in head.iter_mut().zip(&a[..n]).zip(&b[..n]) {
            o.write(f(x, y));
        }
        for o in rest {
            o.write(0.0);
        }
        Written(PhantomData)
    }

    /// Copies `src` into the plane, and zero past its end (there is none when it is as long as
    /// the plane).
    #[inline(always)]
    pub(crate) fn copied(self, src: &[f32]) -> Written<'p> {
        let n = self.slots.len().min(src.len());
        let (head, rest) = self.slots.split_at_mut(n);
        for (o, &x) in head.iter_mut().zip(&src[..n]) {
            o.write(x);
        }
        for o in rest {
            o.write(0.0);
        }
        Written(PhantomData)
    }

    /// Sets every value of the plane to `value`.
    #[inline(always)]
    pub(crate) fn filled(self, value: f32) -> Written<'p> {
        for o in self.slots.iter_mut() {
            o.write(value);
        }
        Written(PhantomData)
    }
}

/// A new vector of `len` values, chunks of `chunk` (the last may be shorter), each zeroed (or,
/// with `start`, set to `start`'s values) and then handed to `fill(index, chunk)`, in
/// parallel when `parallel`. The first error ends the work and is returned. `start` holds at
/// least `len` values.
///
/// Each chunk is set in the task that fills it, just before: those stores go to the cache
/// that `fill`'s stores then hit, where zeroing the whole buffer at allocation would take a
/// pass over memory of its own.
pub(crate) fn try_by_chunk<E: Send>(
    len: usize,
    chunk: usize,
    parallel: bool,
    start: Option<&[f32]>,
    fill: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
) -> Result<Vec<f32>, E> {
    let mut out = Vec::with_capacity(len);
    let slots = &mut out.spare_capacity_mut()[..len];
    let chunk = chunk.max(1);
    let task = |(i, slots): (usize, &mut [MaybeUninit<f32>])| {
        let from = start.and_then(|s| s.get(i * chunk..i * chunk + slots.len()));
        match from {
            Some(from) => {
                for (slot, v) in slots.iter_mut().zip(from) {
                    slot.write(*v);
                }
            }
            None => {
                for slot in slots.iter_mut() {
                    slot.write(0.0);
                }
            }
        }
        // SAFETY: every value was just written, and `MaybeUninit<f32>` has `f32`'s layout.
        fill(i, unsafe {
            &mut *(slots as *mut [MaybeUninit<f32>] as *mut [f32])
        })
    };
    let chunk = chunk.max(1);
    if parallel {
        slots.par_chunks_mut(chunk).enumerate().try_for_each(task)?;
    } else {
        slots.chunks_mut(chunk).enumerate().try_for_each(task)?;
    }
    // SAFETY: the chunks cover the first `len` values; `try_for_each` returned `Ok`, so every
    // chunk's task ran, and each set every value of its chunk first (`zip` stops at neither
    // side early: `from` is as long as the chunk).
    unsafe { out.set_len(len) };
    Ok(out)
}

/// A new output of `images` images of `image_len` values each, written in parts: each part
/// (a concatenation's branch, or a kernel's whole output) writes its own run of values of
/// every image, the images split over tasks in groups ([`Self::try_fill`]). A part's task sets
/// its runs (to zero, or to given values) just before handing them over, in cache; no value
/// outside the parts' runs is touched until [`Self::into_vec`], which zeroes any a part left.
pub(crate) struct PartedOutput {
    /// Capacity for all `images * image_len` values; its length stays zero until
    /// [`Self::into_vec`].
    values: Vec<f32>,
    images: usize,
    image_len: usize,
    /// The runs `(offset, len)` of every image that a part has set.
    written: Vec<(usize, usize)>,
}

/// A task's images of a [`PartedOutput`]: each image's run of the part being written.
pub(crate) struct ImagesMut<'a> {
    images: Vec<&'a mut [f32]>,
}

impl<'a> ImagesMut<'a> {
    /// Runs of images given as slices (a test's, or a caller's own buffers).
    pub(crate) fn new(images: Vec<&'a mut [f32]>) -> Self {
        Self { images }
    }

    /// How many images the task holds.
    pub(crate) fn count(&self) -> usize {
        self.images.len()
    }

    /// Each image's run, in order.
    pub(crate) fn each(&mut self) -> impl Iterator<Item = &mut [f32]> + use<'_, 'a> {
        self.images.iter_mut().map(|image| &mut **image)
    }

    /// Every image's run at once.
    pub(crate) fn all(&mut self) -> &mut [&'a mut [f32]] {
        &mut self.images
    }
}

impl PartedOutput {
    /// An output of `images` images of `image_len` values, none written yet.
    pub(crate) fn new(images: usize, image_len: usize) -> Self {
        Self {
            values: Vec::with_capacity(images * image_len),
            images,
            image_len,
            written: Vec::new(),
        }
    }

    /// Images in the output.
    pub(crate) fn images(&self) -> usize {
        self.images
    }

    /// Values per image.
    pub(crate) fn image_len(&self) -> usize {
        self.image_len
    }

    /// Writes one part: values `offset .. offset + len` of every image, `fill(group index,
    /// images)` for each group of `group` consecutive images (the last may be short), in
    /// parallel when `parallel`. Each run is first set to zero, or with `start` (which holds
    /// a value for every value of the output) to its values there. The first error ends the
    /// work and is returned.
    pub(crate) fn try_fill<E: Send>(
        &mut self,
        (group, parallel): (usize, bool),
        (offset, len): (usize, usize),
        start: Option<&[f32]>,
        fill: impl Fn(usize, ImagesMut<'_>) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        let stride = self.image_len;
        assert!(
            offset + len <= stride,
            "values {offset}..{} of images of {stride}",
            offset + len
        );
        let all = self.images * stride;
        let chunk = (group.max(1) * stride).max(1);
        let slots = &mut self.values.spare_capacity_mut()[..all];
        let task = |(i, chunk_slots): (usize, &mut [MaybeUninit<f32>])| {
            let images = chunk_slots
                .chunks_mut(stride.max(1))
                .enumerate()
                .map(|(k, image)| {
                    let run = &mut image[offset..offset + len];
                    let at = (i * group.max(1) + k) * stride + offset;
                    match start.and_then(|s| s.get(at..at + len)) {
                        Some(from) => {
                            for (slot, v) in run.iter_mut().zip(from) {
                                slot.write(*v);
                            }
                        }
                        None => {
                            for slot in run.iter_mut() {
                                slot.write(0.0);
                            }
                        }
                    }
                    // SAFETY: every value of the run was just written (`zip` stops at neither
                    // side early: `from` is as long as the run), and `MaybeUninit<f32>` has
                    // `f32`'s layout.
                    unsafe { &mut *(run as *mut [MaybeUninit<f32>] as *mut [f32]) }
                })
                .collect();
            fill(i, ImagesMut { images })
        };
        if parallel {
            slots.par_chunks_mut(chunk).enumerate().try_for_each(task)?;
        } else {
            slots.chunks_mut(chunk).enumerate().try_for_each(task)?;
        }
        // `try_for_each` returned `Ok`: every group's task ran and set its runs.
        self.written.push((offset, len));
        Ok(())
    }

    /// The values: each image's runs as its parts wrote them, zero outside every part's.
    pub(crate) fn into_vec(mut self) -> Vec<f32> {
        let stride = self.image_len;
        let all = self.images * stride;
        self.written.sort_unstable();
        let mut gaps = Vec::new();
        let mut covered = 0;
        for &(offset, len) in &self.written {
            if offset > covered {
                gaps.push(covered..offset);
            }
            covered = covered.max(offset + len);
        }
        if covered < stride {
            gaps.push(covered..stride);
        }
        let slots = &mut self.values.spare_capacity_mut()[..all];
        if !gaps.is_empty() {
            slots.par_chunks_mut(stride.max(1)).for_each(|image| {
                for gap in &gaps {
                    for slot in &mut image[gap.clone()] {
                        slot.write(0.0);
                    }
                }
            });
        }
        // SAFETY: every value of every image lies in a run a part set (`written` holds only
        // runs whose `try_fill` returned `Ok`, so set in every image) or in a gap between them,
        // zeroed just above; all `all` values, within the capacity, are initialised.
        unsafe { self.values.set_len(all) };
        self.values
    }
}

/// A new vector of `len` values, planes of `s`: `fill` gets each plane's index, its channel
/// (of `c`; 1 when channels do not matter) and the plane to write, in parallel as in
/// [`for_each_plane`].
pub(crate) fn by_plane(
    len: usize,
    c: usize,
    s: usize,
    fill: impl for<'p> Fn(usize, usize, Plane<'p>) -> Written<'p> + Sync + Send,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    let slots = &mut out.spare_capacity_mut()[..len];
    let planes = len.checked_div(s).unwrap_or(0);
    let (whole, rest) = slots.split_at_mut(planes * s);
    for_each_plane(whole, c, s, |i, ch, slots| {
        fill(i, ch, Plane { slots });
    });
    for o in rest {
        o.write(0.0);
    }
    // SAFETY: `for_each_plane` hands each plane of `whole` to `fill`, which cannot return
    // without the `Written` that only writing the whole plane makes (or unwinds, and this is
    // not reached); the values past the last plane were set just above. So the first `len`
    // values, within the capacity, are all initialised.
    unsafe { out.set_len(len) };
    out
}

/// A channel's planes of a new output, not yet written: one per image, in image order.
pub(crate) struct ChannelPlanes<'a, 'p> {
    planes: ChannelPlanesMut<'a, 'p, MaybeUninit<f32>>,
}

impl<'p> ChannelPlanes<'_, 'p> {
    /// Writes each plane with [`Plane::zip_with`], from the next plane of each input (zero
    /// where an input has run out of planes).
    #[inline(always)]
    pub(crate) fn zip_with<'i>(
        mut self,
        mut a: impl Iterator<Item = &'i [f32]>,
        mut b: impl Iterator<Item = &'i [f32]>,
        f: impl Fn(f32, f32) -> f32,
    ) -> Written<'p> {
        for slots in self.planes.iter_mut() {
            let (pa, pb) = (a.next().unwrap_or(&[]), b.next().unwrap_or(&[]));
            Plane { slots }.zip_with(pa, pb, &f);
        }
        Written(PhantomData)
    }
}

/// A new vector of `len` values, `c` channels of planes of `s` values, and the results of
/// `channel(ch, planes)` for each channel, in parallel as in [`map_channels`].
pub(crate) fn by_channel<R: Send>(
    len: usize,
    c: usize,
    s: usize,
    channel: impl for<'a, 'p> Fn(usize, ChannelPlanes<'a, 'p>) -> (R, Written<'p>) + Sync + Send,
) -> (Vec<f32>, Vec<R>) {
    let mut out = Vec::with_capacity(len);
    let slots = &mut out.spare_capacity_mut()[..len];
    let block = c * s;
    let images = len.checked_div(block).unwrap_or(0);
    let (whole, rest) = slots.split_at_mut(images * block);
    let results = map_channels(whole, c, s, |ch, planes| {
        channel(ch, ChannelPlanes { planes }).0
    });
    for o in rest {
        o.write(0.0);
    }
    // SAFETY: `map_channels` hands every plane of `whole` to exactly one channel's call, which
    // cannot return without the `Written` that only writing all of its planes makes (or
    // unwinds, and this is not reached); the values past the last image were set just above.
    // So the first `len` values, within the capacity, are all initialised.
    unsafe { out.set_len(len) };
    (out, results)
}
