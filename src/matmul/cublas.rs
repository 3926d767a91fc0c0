//! cuBLAS for the products of the linear layers on CUDA `CubeBackend` tensors.
//!
//! Burn's autotuned matmul reaches 200-225 TFLOP/s on the LLaMA-7B products where cuBLAS reaches
//! 760-820 on the same H200 (`benches/cublas_matmul.rs`). cuBLAS runs on its own stream of the
//! device's primary context (the one CubeCL uses) and reads and writes CubeCL's buffers through
//! their device addresses. CubeCL hands out no `CUstream` to order against: CubeCL's stream of
//! the calling thread is drained on the host before each product (its inputs are written, and
//! CubeCL's lazily ordered work on them is done), and CubeCL's later work waits on the device
//! for the product's end through a flag the cuBLAS stream writes (`device_order.rs`), so the host
//! goes on queueing while the product runs. With `DISTFLASH_CUBLAS_HOST_WAITS=1` in the
//! environment (to measure the difference), or where the flag cannot be written, the host also
//! drains the cuBLAS stream after each product.
//!
//! Operands this path cannot take (another runtime or element type, a transposed or broadcast
//! view, a mismatched shape) go back to the caller, which uses Burn's `matmul`. Where libcublas cannot be
//! loaded, the path says so once on stderr and stays off for the process.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{CudaContext, CudaStream};

use super::device_order::DeviceOrder;
use super::transposed::Transposed;

type CudaTensor = CubeTensor<CudaRuntime>;

/// Set once cuBLAS turned out unusable on this machine; the portable path serves from then on.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);

/// Set once the device-side wait turned out unusable (or was switched off by the environment):
/// the host drains the cuBLAS stream after every product from then on.
static HOST_WAITS: AtomicBool = AtomicBool::new(false);

/// The environment variable that switches the device-side wait off.
const HOST_WAITS_VAR: &str = "DISTFLASH_CUBLAS_HOST_WAITS";

thread_local! {
    /// This thread's cuBLAS handle per device index (CubeCL's streams are per thread, too).
    static HANDLES: RefCell<HashMap<usize, Blas>> = RefCell::new(HashMap::new());
}

/// A cuBLAS handle bound to its own stream of one device's primary context.
struct Blas {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    handle: sys::cublasHandle_t,
    /// The device-side wait's flag, made at the first product.
    order: Option<DeviceOrder>,
}

impl Blas {
    fn new(device: usize) -> Result<Self, String> {
        // SAFETY: only tries to open the library, with cudarc's own list of names.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcublas could not be loaded (install the CUDA toolkit's cuBLAS or put \
                 the folder holding libcublas.so on LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        let context = CudaContext::new(device).map_err(|e| format!("CUDA context: {e:?}"))?;
        let stream = context
            .new_stream()
            .map_err(|e| format!("CUDA stream: {e:?}"))?;
        context
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        let handle = blas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
        // SAFETY: the handle and the stream were just created; `Drop` destroys the handle
        // before the stream goes.
        if let Err(e) = unsafe { blas::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
        {
            // SAFETY: the handle is not used after this.
            let _ = unsafe { blas::destroy_handle(handle) };
            return Err(format!("cublasSetStream: {e:?}"));
        }
        if std::env::var(HOST_WAITS_VAR).is_ok_and(|v| v == "1") {
            HOST_WAITS.store(true, Ordering::Relaxed);
        }
        Ok(Self {
            context,
            stream,
            handle,
            order: None,
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is this value's own and nothing uses it after this.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}

/// The cuBLAS element type of a tensor dtype this path takes.
fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

fn cuda_tensor<B: Backend>(tensor: &Tensor<B, 2>) -> Option<CudaTensor> {
    let TensorPrimitive::Float(primitive) = tensor.clone().into_primitive() else {
        return None;
    };
    let any: Box<dyn Any> = Box::new(primitive);
    any.downcast::<CudaTensor>().ok().map(|t| *t)
}

fn from_cuda<B: Backend>(tensor: CudaTensor) -> Tensor<B, 2> {
    let any: Box<dyn Any> = Box::new(tensor);
    let primitive = any
        .downcast::<B::FloatTensorPrimitive>()
        .unwrap_or_else(|_| unreachable!("the operands were this backend's CUDA tensors"));
    Tensor::from_primitive(TensorPrimitive::Float(*primitive))
}

/// The distance between rows of a matrix whose rows are each contiguous (CubeCL pads the rows of
/// some allocations), or `None` for any other layout (a transposed view, a broadcast).
fn row_stride(tensor: &CudaTensor) -> Option<usize> {
    let (shape, strides) = (tensor.meta.shape(), tensor.meta.strides());
    let [rows, cols] = [shape[0], shape[1]];
    let [stride, unit] = [strides[0], strides[1]];
    let rows_contiguous = unit == 1 || cols == 1;
    let rows_apart = stride >= cols || rows == 1;
    (rows_contiguous && rows_apart && stride <= i32::MAX as usize).then_some(stride.max(cols))
}

/// Row-major `[m, k, n]` of a product, when the shapes agree.
fn dims(lhs: &[usize], rhs: &[usize], transposed: Transposed) -> Option<[usize; 3]> {
    let (m, k) = match transposed {
        Transposed::Lhs => (lhs[1], lhs[0]),
        _ => (lhs[0], lhs[1]),
    };
    let (k2, n) = match transposed {
        Transposed::Rhs => (rhs[1], rhs[0]),
        _ => (rhs[0], rhs[1]),
    };
    let fits_i32 = [m, k, n].iter().all(|&d| d > 0 && d <= i32::MAX as usize);
    (k == k2 && fits_i32).then_some([m, k, n])
}

/// The product on cuBLAS, or `None` where this path cannot take the operands.
pub(super) fn product<B: Backend>(
    lhs: &Tensor<B, 2>,
    rhs: &Tensor<B, 2>,
    transposed: Transposed,
) -> Option<Tensor<B, 2>> {
    if UNAVAILABLE.load(Ordering::Relaxed) {
        return None;
    }
    let (a, b) = (cuda_tensor(lhs)?, cuda_tensor(rhs)?);
    if a.dtype != b.dtype || a.device != b.device {
        return None;
    }
    let leading = [row_stride(&a)?, row_stride(&b)?];
    let data_type = data_type(a.dtype)?;
    let [m, k, n] = dims(&a.shape(), &b.shape(), transposed)?;
    let device = a.device.clone();
    HANDLES.with(|handles| {
        let mut handles = handles.borrow_mut();
        let blas = match handles.get_mut(&device.index) {
            Some(blas) => blas,
            None => match Blas::new(device.index) {
                Ok(blas) => handles.entry(device.index).or_insert(blas),
                Err(why) => return disable(&why),
            },
        };
        let out = run(blas, &a, &b, leading, [m, k, n], transposed, data_type);
        out.map(from_cuda)
    })
}

fn disable<T>(why: &str) -> Option<T> {
    if !UNAVAILABLE.swap(true, Ordering::Relaxed) {
        eprintln!(
            "burn-distflash: the linear layers use Burn's matmul instead of cuBLAS on CUDA: {why}"
        );
    }
    None
}

/// One `gemm_ex` call: the handle, device addresses and shapes.
#[derive(Clone, Copy)]
struct Gemm {
    handle: sys::cublasHandle_t,
    /// Addresses of A, B and C.
    operands: [u64; 3],
    leading: [usize; 2],
    dims: [usize; 3],
    transposed: Transposed,
    data_type: sys::cudaDataType,
}

impl Gemm {
    /// Queues the product on the handle's stream.
    ///
    /// # Safety
    /// The addresses hold matrices of `data_type` with these shapes and leading dimensions (C
    /// contiguous), ordered after their writers and before later readers; the handle's context is
    /// current.
    unsafe fn queue(&self) -> Result<(), String> {
        let ([pa, pb, pc], [lda, ldb], [m, k, n]) = (self.operands, self.leading, self.dims);
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's buffer comes
        // first, and a row-major matrix is its column-major transpose with the row stride as
        // leading dimension.
        let op = |t| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        let (op_a, op_b) = (
            op(self.transposed == Transposed::Lhs),
            op(self.transposed == Transposed::Rhs),
        );
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: as the caller vouches.
        unsafe {
            blas::gemm_ex(
                self.handle,
                op_b,
                op_a,
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast::<c_void>(),
                pb as *const c_void,
                self.data_type,
                ldb as i32,
                pa as *const c_void,
                self.data_type,
                lda as i32,
                (&beta as *const f32).cast::<c_void>(),
                pc as *mut c_void,
                self.data_type,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("cublasGemmEx failed: {e:?}"))
    }
}

/// Allocates the output and queues `gemm_ex` on the cuBLAS stream, after CubeCL's work so far
/// (a host wait) and before CubeCL's next work (on the device through the flag, or a host wait).
fn run(
    blas: &mut Blas,
    a: &CudaTensor,
    b: &CudaTensor,
    leading: [usize; 2],
    dims: [usize; 3],
    transposed: Transposed,
    data_type: sys::cudaDataType,
) -> Option<CudaTensor> {
    let (client, device) = (&a.client, &a.device);
    let [m, _, n] = dims;
    let out = CudaTensor::new_contiguous(
        client.clone(),
        device.clone(),
        Shape::from([m, n]),
        client.empty(m * n * a.dtype.size()),
        a.dtype,
    );
    let address = |t: &CudaTensor| {
        client
            .get_resource(t.handle.clone())
            .unwrap_or_else(|e| panic!("the device address of a CUDA tensor: {e}"))
    };
    // Kept alive (and their memory out of the pool) until the product is queued, and with host
    // waits until it has run.
    let resources = [address(a), address(b), address(&out)];
    let gemm = Gemm {
        handle: blas.handle,
        operands: resources.each_ref().map(|r| r.resource().ptr),
        leading,
        dims,
        transposed,
        data_type,
    };
    cubecl::future::block_on(client.sync())
        .unwrap_or_else(|e| panic!("CubeCL's stream failed before a cuBLAS product: {e}"));
    if let Err(e) = blas.context.bind_to_thread() {
        return disable(&format!("binding the CUDA context: {e:?}"));
    }
    // SAFETY: the operands are as `Gemm::queue` needs; CubeCL has drained (its writes to them
    // are done), and runs nothing after the product until it has run (below).
    if let Err(why) = unsafe { gemm.queue() } {
        return disable(&why);
    }
    let mut waited_on_device = false;
    if !HOST_WAITS.load(Ordering::Relaxed) {
        let order = blas.order.get_or_insert_with(|| DeviceOrder::new(client));
        // SAFETY: the cuBLAS stream of the flag's device, its context current; CubeCL drained
        // above.
        match unsafe { order.signal(blas.stream.cu_stream()) } {
            Ok(()) => {
                order.await_signal(client);
                waited_on_device = true;
            }
            Err(e) => host_waits_from_now(&format!("cuMemsetD32Async: {e:?}")),
        }
    }
    if !waited_on_device {
        blas.stream
            .synchronize()
            .unwrap_or_else(|e| panic!("a cuBLAS product failed on the GPU: {e:?}"));
    }
    drop(resources);
    Some(out)
}

/// Switches the device-side ordering off for the process, saying why once on stderr.
fn host_waits_from_now(why: &str) {
    if !HOST_WAITS.swap(true, Ordering::Relaxed) {
        eprintln!("burn-distflash: cuBLAS products are ordered by host waits: {why}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, TensorData};
    use burn_cubecl::CubeBackend;
    use cubecl::cuda::CudaDevice;

    /// Largest difference to the f64 product of the same (rounded) operands, relative to the
    /// product's largest magnitude.
    fn relative_error<B: Backend>(lhs: &Tensor<B, 2>, rhs: &Tensor<B, 2>, t: Transposed) -> f64 {
        let out = product(lhs, rhs, t).expect("cuBLAS takes CUDA operands with contiguous rows");
        assert_eq!(out.dtype(), lhs.dtype());
        error_of(lhs, rhs, t, out)
    }

    /// Burn's own product, for the message.
    fn burns_error<B: Backend>(lhs: &Tensor<B, 2>, rhs: &Tensor<B, 2>, t: Transposed) -> f64 {
        let out = match t {
            Transposed::Neither => lhs.clone().matmul(rhs.clone()),
            Transposed::Lhs => lhs.clone().transpose().matmul(rhs.clone()),
            Transposed::Rhs => lhs.clone().matmul(rhs.clone().transpose()),
        };
        error_of(lhs, rhs, t, out)
    }

    fn error_of<B: Backend>(
        lhs: &Tensor<B, 2>,
        rhs: &Tensor<B, 2>,
        t: Transposed,
        out: Tensor<B, 2>,
    ) -> f64 {
        let read = |x: &Tensor<B, 2>| -> (Vec<f64>, [usize; 2]) {
            let data = x.to_data().convert::<f64>();
            let dims = [data.shape[0], data.shape[1]];
            (data.to_vec::<f64>().unwrap(), dims)
        };
        let ((a, [ar, ac]), (b, [br, bc]), (c, [m, n])) = (read(lhs), read(rhs), read(&out));
        let k = if t == Transposed::Lhs { ar } else { ac };
        let at = |i: usize, p: usize| {
            if t == Transposed::Lhs {
                a[p * ac + i]
            } else {
                a[i * ac + p]
            }
        };
        let bt = |p: usize, j: usize| {
            if t == Transposed::Rhs {
                b[j * bc + p]
            } else {
                b[p * bc + j]
            }
        };
        assert_eq!(
            [m, n],
            [
                if t == Transposed::Lhs { ac } else { ar },
                if t == Transposed::Rhs { br } else { bc }
            ]
        );
        let (mut worst, mut scale) = (0.0f64, 0.0f64);
        for i in 0..m {
            for j in 0..n {
                let exact: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                worst = worst.max((exact - c[i * n + j]).abs());
                scale = scale.max(exact.abs());
            }
        }
        worst / scale
    }

    fn every_layout(dtype: DType, tolerance: f64) {
        type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
        let device = CudaDevice::new(0);
        let normal = Distribution::Normal(0.0, 1.0);
        for [m, k, n] in [[37, 53, 29], [1, 1, 1], [256, 512, 384]] {
            let random = |dims: [usize; 2]| {
                let t = Tensor::<Cuda, 2>::random(dims, normal, &device).cast(dtype);
                assert_eq!(t.dtype(), dtype);
                t
            };
            let cases = [
                (random([m, k]), random([k, n]), Transposed::Neither),
                (random([k, m]), random([k, n]), Transposed::Lhs),
                (random([m, k]), random([n, k]), Transposed::Rhs),
            ];
            for (lhs, rhs, t) in cases {
                let error = relative_error(&lhs, &rhs, t);
                let burn = burns_error(&lhs, &rhs, t);
                println!("{m}x{k}x{n} {t:?}: cuBLAS {error:.2e}, Burn's matmul {burn:.2e}");
                assert!(
                    error < tolerance,
                    "{m}x{k}x{n} {t:?}: relative error {error:.2e} (Burn's matmul: {burn:.2e})"
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_products_match_f64_in_every_layout_and_dtype() {
        every_layout(DType::F32, 1e-5);
        every_layout(DType::BF16, 1e-2);
        every_layout(DType::F16, 2e-3);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_rows_sliced_out_of_a_buffer_are_read_from_their_offset() {
        type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
        let device = CudaDevice::new(0);
        let values: Vec<f32> = (0..40 * 16)
            .map(|i| ((i * 7919) % 97) as f32 / 97.0)
            .collect();
        let whole = Tensor::<Cuda, 2>::from_data(TensorData::new(values, [40, 16]), &device);
        let rows = whole.slice([3..40, 0..16]);
        let rhs = Tensor::<Cuda, 2>::random([16, 9], Distribution::Default, &device);
        assert!(relative_error(&rows, &rhs, Transposed::Neither) < 1e-5);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_strided_views_and_other_backends_are_left_to_burn() {
        type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
        let device = CudaDevice::new(0);
        let a = Tensor::<Cuda, 2>::random([8, 4], Distribution::Default, &device);
        let b = Tensor::<Cuda, 2>::random([8, 4], Distribution::Default, &device);
        assert!(product(&a.clone().transpose(), &b, Transposed::Neither).is_none());
        type Cpu = burn_ndarray::NdArray<f32>;
        let c = Tensor::<Cpu, 2>::random([8, 4], Distribution::Default, &Default::default());
        assert!(product(&c, &c.clone().transpose(), Transposed::Neither).is_none());
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_chained_products_are_waited_for_on_the_device() {
        // Each product's output is changed by a CubeCL kernel queued while the product runs, and
        // read by the next product; every intermediate is dropped (its memory goes back to
        // CubeCL's pool) as soon as it is queued: without the device-side wait the kernel reads
        // rows the product has not written yet.
        type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
        let device = CudaDevice::new(0);
        let [rows, width, steps] = [256, 512, 24];
        let normal = Distribution::Normal(0.0, 1.0);
        let scale = 1.0 / (width as f64).sqrt();
        let x0 = Tensor::<Cuda, 2>::random([rows, width], normal, &device);
        let w = Tensor::<Cuda, 2>::random([width, width], normal, &device) * scale;
        let mut x = x0.clone();
        for _ in 0..steps {
            let y = product(&x, &w, Transposed::Neither).expect("cuBLAS takes these operands");
            x = y * 0.9 + 0.1;
        }
        let device_ordered = !HOST_WAITS.load(Ordering::Relaxed);
        let got = x.to_data().convert::<f64>().to_vec::<f64>().unwrap();
        let read = |t: &Tensor<Cuda, 2>| t.to_data().convert::<f64>().to_vec::<f64>().unwrap();
        let (mut expected, w) = (read(&x0), read(&w));
        for _ in 0..steps {
            let mut next = vec![0.0f64; rows * width];
            for i in 0..rows {
                for p in 0..width {
                    let a = expected[i * width + p];
                    for j in 0..width {
                        next[i * width + j] += a * w[p * width + j];
                    }
                }
            }
            expected = next.into_iter().map(|v| v * 0.9 + 0.1).collect();
        }
        let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&expected)
            .fold(0.0f64, |m, (g, e)| m.max((g - e).abs()));
        assert!(
            worst / scale < 1e-4,
            "{steps} chained products: relative error {:.2e}",
            worst / scale
        );
        let forced = std::env::var(HOST_WAITS_VAR).is_ok_and(|v| v == "1");
        assert!(
            device_ordered || forced,
            "the products fell back to host waits (see stderr)"
        );
    }

    #[test]
    fn shapes_are_read_per_layout_and_mismatches_refused() {
        assert_eq!(dims(&[4, 3], &[3, 5], Transposed::Neither), Some([4, 3, 5]));
        assert_eq!(dims(&[3, 4], &[3, 5], Transposed::Lhs), Some([4, 3, 5]));
        assert_eq!(dims(&[4, 3], &[5, 3], Transposed::Rhs), Some([4, 3, 5]));
        assert_eq!(dims(&[4, 3], &[4, 5], Transposed::Neither), None);
        assert_eq!(dims(&[4, 0], &[0, 5], Transposed::Neither), None);
    }
}
