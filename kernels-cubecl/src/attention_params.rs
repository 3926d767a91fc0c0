//! The values of one attention call that every attention kernel reads, as one launch argument:
//! the lengths and heads, the score scale, the mask's run-time bounds and, compiled in, the head
//! dimension and the mask's shape. Built once per call on the host from the validated dimensions
//! and options; the portable kernels take it through CubeCL's launcher, the tensor-core kernels
//! through `tensor_core::fast_exp2::LaunchArguments` (the same values in the same order).

use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::grid::Rows;
use crate::mask::{KernelMask, MaskBounds, MaskBoundsCompilationArg, MaskBoundsLaunch, MaskKind};
use crate::step_options::StepOptions;

/// One attention call's parameters, as every attention kernel (portable and tensor-core,
/// forward and backward) takes them. Run-time values are kernel scalars; `head_dim` and
/// `mask_kind` are compiled into the kernel.
///
/// The scalars are registered in field order (nested fields in place) and packed by type, so
/// the order of fields of one type is part of the contract with the tensor-core launches.
#[derive(CubeType, CubeLaunch, Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Score scale applied to `q . k`.
    pub scale: f32,
    /// Query rows of the call.
    pub q_len: u32,
    /// Key rows of the call.
    pub kv_len: u32,
    /// Heads of the (batch, head) slices the kernel's grid walks: query heads for the kernels
    /// over blocks of query rows, key/value heads for those over blocks of keys.
    pub heads: u32,
    /// Query heads per key/value head.
    pub group_size: u32,
    /// The mask's run-time values, in rows local to the call.
    pub bounds: MaskBounds,
    /// Head dimension (compiled in).
    #[cube(comptime)]
    pub head_dim: usize,
    /// Which parts of the mask the kernel applies (compiled in).
    #[cube(comptime)]
    pub mask_kind: MaskKind,
}

/// One call's [`AttentionParams`] for both kinds of kernels, built once from the validated
/// inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CallParams {
    /// For the kernels over blocks of query rows (forward, dQ).
    pub queries: AttentionParams,
    /// For the kernels over blocks of keys (dK/dV).
    pub keys: AttentionParams,
}

impl CallParams {
    /// The parameters of a call of validated `dims` with validated `options`.
    pub(crate) fn new(dims: &AttentionDims, options: &StepOptions) -> Self {
        Self {
            queries: AttentionParams::new(dims, options, Rows::Query),
            keys: AttentionParams::new(dims, options, Rows::Key),
        }
    }
}

impl AttentionParams {
    /// The parameters of a call of validated `dims` with validated `options` (see
    /// [`crate::check_launch`]) for kernels over blocks of `rows`: the resolved scale, the
    /// mask's bounds and shape, the heads of `rows`.
    pub(crate) fn new(dims: &AttentionDims, options: &StepOptions, rows: Rows) -> Self {
        let heads = match rows {
            Rows::Query => dims.q_heads,
            Rows::Key => dims.kv_heads,
        };
        Self {
            scale: options.resolved_scale(dims.head_dim),
            q_len: dims.q_len as u32,
            kv_len: dims.kv_len as u32,
            heads: heads as u32,
            group_size: dims.group_size() as u32,
            bounds: options.mask.bounds(dims),
            head_dim: dims.head_dim,
            mask_kind: options.mask.kind(),
        }
    }

    /// These parameters as an argument of CubeCL's launcher.
    pub(crate) fn launch_arg<R: Runtime>(&self) -> AttentionParamsLaunch<R> {
        let b = &self.bounds;
        AttentionParamsLaunch::new(
            self.scale,
            self.q_len,
            self.kv_len,
            self.heads,
            self.group_size,
            MaskBoundsLaunch::new(
                b.shift,
                b.before,
                b.after,
                b.q_pos0,
                b.kv_pos0,
                b.doc_stride,
                b.doc_count,
            ),
            self.head_dim,
            self.mask_kind,
        )
    }

    /// What a kernel's definition takes for parameters of this head dimension and mask shape
    /// (the run-time values are registered apart).
    pub fn compilation_arg(head_dim: usize, mask_kind: MaskKind) -> AttentionParamsCompilationArg {
        AttentionParamsCompilationArg {
            scale: (),
            q_len: (),
            kv_len: (),
            heads: (),
            group_size: (),
            bounds: MaskBoundsCompilationArg {
                shift: (),
                before: (),
                after: (),
                q_pos0: (),
                kv_pos0: (),
                doc_stride: (),
                doc_count: (),
            },
            head_dim,
            mask_kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    use super::*;
    use crate::tensor::{DeviceTensor, ElemType};
    use crate::tensor_core::fast_exp2::{self, LaunchArguments};
    use crate::{Documents, Mask, SlidingWindow};

    /// Fields of [`AttentionParams`] that [`echo_params`] writes, in its order.
    const ECHOED: usize = 14;

    /// Writes every field of `params` to `out` as f32, comptime ones included.
    #[cube(launch, launch_unchecked)]
    fn echo_params(out: &mut Array<f32>, params: &AttentionParams) {
        if UNIT_POS == 0 {
            let b = &params.bounds;
            out[0] = params.scale;
            out[1] = f32::cast_from(params.q_len);
            out[2] = f32::cast_from(params.kv_len);
            out[3] = f32::cast_from(params.heads);
            out[4] = f32::cast_from(params.group_size);
            out[5] = f32::cast_from(b.shift);
            out[6] = f32::cast_from(b.before);
            out[7] = f32::cast_from(b.after);
            out[8] = f32::cast_from(b.q_pos0);
            out[9] = f32::cast_from(b.kv_pos0);
            out[10] = f32::cast_from(b.doc_stride);
            out[11] = f32::cast_from(b.doc_count);
            out[12] = comptime!(params.head_dim as f32).runtime();
            let kind = comptime!(params.mask_kind);
            out[13] = comptime!(
                (kind.upper as u32 + 2 * kind.lower as u32 + 4 * kind.documents as u32) as f32
            )
            .runtime();
        }
    }

    /// The parameters of a GQA call with a causal window over documents, at offsets, for
    /// kernels over blocks of `rows`.
    fn call_params(rows: Rows) -> AttentionParams {
        let dims = AttentionDims {
            batch: 2,
            q_heads: 6,
            kv_heads: 3,
            q_len: 40,
            kv_len: 90,
            head_dim: 32,
        };
        let documents = Documents::per_batch_row(&[vec![0, 20, 100], vec![0, 100]]).unwrap();
        let options = StepOptions {
            mask: Mask::causal()
                .with_window(SlidingWindow::two_sided(7, 0))
                .with_documents(documents)
                .at(50, 9),
            scale: Some(0.375),
            ..StepOptions::default()
        };
        AttentionParams::new(&dims, &options, rows)
    }

    /// Parameters whose run-time fields all differ (no call has them: two fields swapped on the
    /// way to the kernel would show).
    fn distinct_params() -> AttentionParams {
        AttentionParams {
            scale: 0.25,
            q_len: 1,
            kv_len: 2,
            heads: 3,
            group_size: 4,
            bounds: MaskBounds {
                shift: -5,
                before: 6,
                after: -7,
                q_pos0: 8,
                kv_pos0: 9,
                doc_stride: 10,
                doc_count: 11,
            },
            head_dim: 64,
            mask_kind: MaskKind {
                upper: true,
                lower: false,
                documents: true,
            },
        }
    }

    fn expected(p: &AttentionParams) -> Vec<f32> {
        let b = &p.bounds;
        let kind = p.mask_kind;
        let kind_bits = kind.upper as u32 + 2 * kind.lower as u32 + 4 * kind.documents as u32;
        vec![
            p.scale,
            p.q_len as f32,
            p.kv_len as f32,
            p.heads as f32,
            p.group_size as f32,
            b.shift as f32,
            b.before as f32,
            b.after as f32,
            b.q_pos0 as f32,
            b.kv_pos0 as f32,
            b.doc_stride as f32,
            b.doc_count as f32,
            p.head_dim as f32,
            kind_bits as f32,
        ]
    }

    #[test]
    fn the_parameters_hold_the_call_dims_and_mask() {
        // shift = 50 - 9; a causal window sees 7 keys before and none after; two batch rows of
        // documents, padded to three bounds each.
        let rest = [2.0, 41.0, 7.0, 0.0, 50.0, 9.0, 3.0, 3.0, 32.0, 7.0];
        let with_heads = |heads: f32| [[0.375, 40.0, 90.0, heads].as_slice(), &rest].concat();
        assert_eq!(expected(&call_params(Rows::Query)), with_heads(6.0));
        assert_eq!(expected(&call_params(Rows::Key)), with_heads(3.0));
    }

    /// Both host paths, CubeCL's launcher and the tensor-core launches' `LaunchArguments`,
    /// register the parameters in the order the kernel reads them.
    #[test]
    fn both_launch_paths_deliver_every_field() {
        let client = WgpuRuntime::client(&WgpuDevice::Cpu);
        let p = distinct_params();
        let out = DeviceTensor::empty(&client, vec![ECHOED], ElemType::F32);
        echo_params::launch::<WgpuRuntime>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            out.array_arg(),
            p.launch_arg(),
        );
        assert_eq!(out.to_f32(&client), expected(&p), "CubeCL's launcher");

        let out = DeviceTensor::empty(&client, vec![ECHOED], ElemType::F32);
        let mut args = LaunchArguments::new(AddressType::U32);
        let kernel = echo_params::EchoParams::<WgpuRuntime>::new(
            KernelSettings::default().cube_dim(CubeDim::new_1d(1)),
            client.clone(),
            args.array(&out),
            args.params(&p),
        );
        // SAFETY: the kernel writes `ECHOED` elements of an array of that length.
        unsafe {
            fast_exp2::launch_unchecked(&client, CubeCount::Static(1, 1, 1), kernel, args);
        }
        assert_eq!(out.to_f32(&client), expected(&p), "LaunchArguments");
    }
}
