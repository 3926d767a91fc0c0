//! A safetensors file written tensor by tensor and piece by piece: the header is made from the
//! tensors' declared types and shapes, then each tensor's bytes are handed over in pieces of any
//! size, so that no whole tensor (an optimizer shard's vectors, tens of GiB at long sequences)
//! needs to exist in host memory at once. The file is what the `safetensors` crate writes for
//! the same tensors (its own header type, padded to 8 bytes), and reads back the same way.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

use burn::tensor::{DType, TensorData};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::Error;

/// A tensor of a streamed file: its name, type and shape. Its bytes come from the caller's
/// pieces, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedTensor {
    /// The tensor's name in the file.
    pub name: String,
    /// Its element type: F32, F16 or BF16.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl StreamedTensor {
    /// The tensor's bytes.
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Where the pieces of one tensor go: each piece in the tensor's type, in order.
pub type PieceSink<'a> = dyn FnMut(TensorData) -> Result<(), Error> + 'a;

/// Writes `tensors` to `path` with `format: "pt"` and the `extra` entries in `__metadata__` (a
/// `format` among them replaces it), through a temporary name (an interrupted write leaves no
/// file under `path`): `pieces(i, sink)` hands tensor `i`'s elements to `sink` in consecutive
/// pieces, which are written as they come.
///
/// # Errors
///
/// [`Error::Unsupported`] for a type other than F32, F16 or BF16; [`Error::Invalid`] when a
/// piece is of another type or the pieces of a tensor do not make up its declared size (no file
/// is left then); [`Error::Io`] when writing fails; the errors `pieces` returns.
pub fn write_safetensors_streamed(
    path: &Path,
    tensors: &[StreamedTensor],
    extra: HashMap<String, String>,
    pieces: &mut dyn FnMut(usize, &mut PieceSink<'_>) -> Result<(), Error>,
) -> Result<(), Error> {
    let header = header_bytes(path, tensors, extra)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp_path = path.with_file_name(format!(".{file_name}.tmp"));
    let written = write_body(&tmp_path, &header, tensors, pieces).and_then(|()| {
        fs::rename(&tmp_path, path).map_err(Error::io("rename the written file to", path))
    });
    if written.is_err() {
        // Best effort: the temporary file may not exist if creating it failed.
        let _ = fs::remove_file(&tmp_path);
    }
    written
}

/// The header's length (8 bytes, little-endian) and the header itself, padded with spaces to a
/// multiple of 8 bytes, as the `safetensors` crate lays them out.
fn header_bytes(
    path: &Path,
    tensors: &[StreamedTensor],
    extra: HashMap<String, String>,
) -> Result<Vec<u8>, Error> {
    let mut offset = 0;
    let mut infos = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        let dtype = stored(tensor.dtype).ok_or_else(|| Error::Unsupported {
            path: Some(path.to_path_buf()),
            what: format!("the dtype of tensor `{}`", tensor.name),
            expected: "F32, F16 and BF16".into(),
            got: format!("{:?}", tensor.dtype),
        })?;
        let end = offset + tensor.bytes();
        let info = TensorInfo {
            dtype,
            shape: tensor.shape.clone(),
            data_offsets: (offset, end),
        };
        infos.push((tensor.name.clone(), info));
        offset = end;
    }
    let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    metadata.extend(extra);
    let header = Metadata::new(Some(metadata), infos).map_err(|e| Error::Format {
        path: Some(path.to_path_buf()),
        what: "the header".into(),
        expected: "a valid safetensors header".into(),
        source: Box::new(e),
    })?;
    let mut json = serde_json::to_string(&header)
        .expect("a safetensors header serialises")
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    Ok(bytes)
}

fn stored(dtype: DType) -> Option<Dtype> {
    match dtype {
        DType::F32 => Some(Dtype::F32),
        DType::F16 => Some(Dtype::F16),
        DType::BF16 => Some(Dtype::BF16),
        _ => None,
    }
}

/// Writes the header, then each tensor's pieces, to `tmp_path`, checking each tensor's size.
fn write_body(
    tmp_path: &Path,
    header: &[u8],
    tensors: &[StreamedTensor],
    pieces: &mut dyn FnMut(usize, &mut PieceSink<'_>) -> Result<(), Error>,
) -> Result<(), Error> {
    let write_error = Error::io("write the safetensors file", tmp_path);
    let file = File::create(tmp_path).map_err(Error::io("create", tmp_path))?;
    let mut out = BufWriter::with_capacity(1 << 22, file);
    out.write_all(header).map_err(write_error)?;
    for (i, tensor) in tensors.iter().enumerate() {
        let mut written = 0usize;
        let mut sink = |piece: TensorData| -> Result<(), Error> {
            if piece.dtype != tensor.dtype {
                return Err(Error::Invalid {
                    path: Some(tmp_path.to_path_buf()),
                    what: format!("a piece of tensor `{}`", tensor.name),
                    expected: format!("{:?}, the tensor's declared type", tensor.dtype),
                    got: format!("{:?}", piece.dtype),
                });
            }
            written += piece.bytes.len();
            out.write_all(&piece.bytes)
                .map_err(Error::io("write the safetensors file", tmp_path))
        };
        pieces(i, &mut sink)?;
        if written != tensor.bytes() {
            return Err(Error::Invalid {
                path: Some(tmp_path.to_path_buf()),
                what: format!("the bytes written of tensor `{}`", tensor.name),
                expected: format!(
                    "{}, its shape {:?} in {:?}",
                    tensor.bytes(),
                    tensor.shape,
                    tensor.dtype
                ),
                got: written.to_string(),
            });
        }
    }
    let file = out
        .into_inner()
        .map_err(|e| Error::io("write the safetensors file", tmp_path)(e.into_error()))?;
    file.sync_all()
        .map_err(Error::io("write the safetensors file", tmp_path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::{write_safetensors_with_metadata, Checkpoint};
    use distflash_test_support::TempDir;
    use std::collections::BTreeMap;

    fn f32_pieces(values: &[f32], piece: usize) -> Vec<TensorData> {
        values
            .chunks(piece)
            .map(|c| TensorData::new(c.to_vec(), [c.len()]))
            .collect()
    }

    fn tensors() -> Vec<StreamedTensor> {
        vec![
            StreamedTensor {
                name: "master".into(),
                dtype: DType::F32,
                shape: vec![7],
            },
            StreamedTensor {
                name: "moment_1".into(),
                dtype: DType::F32,
                shape: vec![2, 3],
            },
        ]
    }

    #[test]
    fn pieces_of_any_size_make_the_file_the_crate_writes_for_the_whole_tensors() {
        let dir = TempDir::new("streamed_safetensors");
        let values: [Vec<f32>; 2] = [
            (0..7).map(|i| i as f32 * 0.5 - 1.0).collect(),
            (0..6).map(|i| (i as f32).exp()).collect(),
        ];
        let extra = HashMap::from([("rank".to_string(), "1".to_string())]);
        for piece in [1, 2, 3, 7, 100] {
            let path = dir.path().join(format!("streamed{piece}.safetensors"));
            write_safetensors_streamed(&path, &tensors(), extra.clone(), &mut |i, sink| {
                f32_pieces(&values[i], piece).into_iter().try_for_each(sink)
            })
            .unwrap();
            let whole = dir.path().join("whole.safetensors");
            let data: BTreeMap<String, TensorData> = tensors()
                .iter()
                .zip(&values)
                .map(|(t, v)| (t.name.clone(), TensorData::new(v.clone(), t.shape.clone())))
                .collect();
            write_safetensors_with_metadata(&whole, &data, extra.clone()).unwrap();
            let file = Checkpoint::open_file(&path).unwrap();
            let reference = Checkpoint::open_file(&whole).unwrap();
            for t in tensors() {
                let (got, want) = (file.get(&t.name).unwrap(), reference.get(&t.name).unwrap());
                assert_eq!(
                    (got.dtype, got.shape, got.bytes),
                    (want.dtype, want.shape, want.bytes),
                    "{} in pieces of {piece}",
                    t.name
                );
                assert_eq!(file.metadata_of(&t.name), reference.metadata_of(&t.name));
            }
            assert!(!dir
                .path()
                .join(format!(".streamed{piece}.safetensors.tmp"))
                .exists());
        }
    }

    #[test]
    fn short_long_or_mistyped_pieces_are_refused_and_leave_no_file() {
        let dir = TempDir::new("streamed_safetensors_bad");
        let path = dir.path().join("bad.safetensors");
        let cases: [(&str, Vec<TensorData>); 3] = [
            ("the bytes written", f32_pieces(&[1.0; 6], 4)),
            ("the bytes written", f32_pieces(&[1.0; 8], 4)),
            (
                "a piece of tensor",
                vec![TensorData::new(vec![1.0f32; 7], [7]).convert_dtype(DType::BF16)],
            ),
        ];
        for (what, pieces) in cases {
            let err = write_safetensors_streamed(
                &path,
                &tensors()[..1],
                HashMap::new(),
                &mut |_, sink| pieces.clone().into_iter().try_for_each(&mut *sink),
            )
            .unwrap_err();
            assert!(err.to_string().contains(what), "{what}: {err}");
            assert!(!path.exists(), "{what}: a file was left");
            assert!(!dir.path().join(".bad.safetensors.tmp").exists());
        }
        let f64_tensor = [StreamedTensor {
            name: "x".into(),
            dtype: DType::F64,
            shape: vec![1],
        }];
        let err =
            write_safetensors_streamed(&path, &f64_tensor, HashMap::new(), &mut |_, _| Ok(()))
                .unwrap_err();
        assert!(err.to_string().contains("F32, F16 and BF16"), "{err}");
    }
}
