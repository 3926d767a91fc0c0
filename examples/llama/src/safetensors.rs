//! Hugging Face safetensors checkpoints, read and written through the `safetensors` crate.
//!
//! A [`Checkpoint`] memory-maps its files and hands out one tensor at a time as Burn
//! [`TensorData`] in the dtype it is stored in (F32, F16 or BF16): nothing is widened to `f32` on
//! the host, so loading a bf16 checkpoint never holds an `f32` copy of it; the conversion to the
//! model's float type happens tensor by tensor as each is placed on its device. A checkpoint is
//! one `model.safetensors` or the shards that `model.safetensors.index.json` lists (the
//! `safetensors` crate reads single files; the index is read here).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File};
use std::path::{Component, Path, PathBuf};

use burn::tensor::{DType, TensorData};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};
use serde::Deserialize;

use crate::Error;

/// File name of a single-file checkpoint inside a model directory.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";

/// File name of the shard index of a sharded checkpoint inside a model directory.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// The dtypes this crate reads and writes, for errors.
const SUPPORTED_DTYPES: &str = "F32, F16 and BF16";

/// The error of a tensor stored, or to be written, in a dtype this crate does not handle.
fn unsupported_dtype(path: &Path, tensor: &str, dtype: impl fmt::Debug) -> Error {
    Error::Unsupported {
        path: Some(path.to_path_buf()),
        what: format!("the dtype of tensor `{tensor}`"),
        expected: SUPPORTED_DTYPES.to_string(),
        got: format!("{dtype:?}"),
    }
}

/// Burn's dtype for a stored one; `None` for dtypes this crate does not load.
fn burn_dtype(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// The stored dtype for a Burn one; `None` for dtypes this crate does not write.
fn stored_dtype(dtype: DType) -> Option<Dtype> {
    match dtype {
        DType::F32 => Some(Dtype::F32),
        DType::F16 => Some(Dtype::F16),
        DType::BF16 => Some(Dtype::BF16),
        _ => None,
    }
}

/// One tensor as stored: its dtype, shape and little-endian bytes, borrowed from the mapped file.
#[derive(Debug, Clone, Copy)]
pub struct StoredTensor<'a> {
    /// Element type on disk (F32, F16 or BF16).
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// The row-major values' bytes, exactly as in the file.
    pub bytes: &'a [u8],
}

impl StoredTensor<'_> {
    /// A copy of the tensor as Burn data, in its stored dtype.
    pub fn to_data(&self) -> TensorData {
        TensorData::from_bytes_vec(self.bytes.to_vec(), self.shape.to_vec(), self.dtype)
    }
}

/// One mapped safetensors file and its parsed header.
struct MappedFile {
    path: PathBuf,
    map: Mmap,
    /// Offset of the data section (after the length prefix and the header).
    data_start: usize,
    metadata: Metadata,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self, Error> {
        let file = File::open(path).map_err(Error::io("open the safetensors file", path))?;
        // SAFETY: the map is read-only and private to this process. As with every memory-mapped
        // checkpoint loader (the `safetensors` crate's own examples, candle, burn-store), the
        // file must not be truncated or rewritten by another process while the map lives: the
        // checkpoint is only read for the duration of one load.
        let map =
            unsafe { Mmap::map(&file) }.map_err(Error::io("map the safetensors file", path))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| invalid(path, "the file", e))?;
        for (name, info) in metadata.tensors() {
            if burn_dtype(info.dtype).is_none() {
                return Err(unsupported_dtype(path, &name, info.dtype));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            map,
            data_start: 8 + header_len,
            metadata,
        })
    }

    fn names(&self) -> Vec<String> {
        self.metadata.tensors().into_keys().collect()
    }

    fn tensor(&self, name: &str) -> Option<StoredTensor<'_>> {
        let info = self.metadata.info(name)?;
        let (begin, end) = info.data_offsets;
        Some(StoredTensor {
            // Checked in `open`.
            dtype: burn_dtype(info.dtype)?,
            shape: &info.shape,
            // `read_metadata` checked that the offsets lie inside the data section.
            bytes: &self.map[self.data_start + begin..self.data_start + end],
        })
    }
}

/// The error of bytes that are not a valid safetensors file: `what` is "the file" when read,
/// "the data written" when written.
fn invalid(path: &Path, what: &str, e: SafeTensorError) -> Error {
    Error::Format {
        path: Some(path.to_path_buf()),
        what: what.to_string(),
        expected: "a valid safetensors file".to_string(),
        source: Box::new(e),
    }
}

/// The shard index's one field this crate reads.
#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// A checkpoint's tensors, mapped from one file or from the shards of an index.
pub struct Checkpoint {
    files: Vec<MappedFile>,
    /// Each tensor's file (an index into `files`).
    location: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Maps one safetensors file.
    pub fn open_file(path: &Path) -> Result<Self, Error> {
        let file = MappedFile::open(path)?;
        let location = file.names().into_iter().map(|name| (name, 0)).collect();
        Ok(Self {
            files: vec![file],
            location,
        })
    }

    /// Maps a Hugging Face model directory's weights: `model.safetensors` when it exists (as
    /// `transformers` does), otherwise every shard that `model.safetensors.index.json` lists in
    /// its `weight_map`. Shard names must be plain file names inside `dir`; every tensor the
    /// index lists must be in the shard it names, and no tensor may appear in two shards.
    /// Tensors present in a shard but absent from the index are kept.
    pub fn open_dir(dir: &Path) -> Result<Self, Error> {
        let single = dir.join(SINGLE_FILE_NAME);
        if single.is_file() {
            return Self::open_file(&single);
        }
        let index_path = dir.join(INDEX_FILE_NAME);
        if !index_path.exists() {
            return Err(Error::NotFound {
                path: single,
                expected: format!("it, or the shard index {INDEX_FILE_NAME} next to it"),
            });
        }
        let index_err = |what: String, expected: String, got: String| Error::Invalid {
            path: Some(index_path.clone()),
            what,
            expected,
            got,
        };
        let text = fs::read_to_string(&index_path)
            .map_err(Error::io("read the shard index", &index_path))?;
        let index: ShardIndex = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: Some(index_path.clone()),
            what: "the shard index".to_string(),
            expected: "{\"weight_map\": {tensor name: shard file name}}".to_string(),
            source: Box::new(e),
        })?;
        if index.weight_map.is_empty() {
            return Err(index_err(
                "`weight_map`".to_string(),
                "at least one tensor name with its shard file name".to_string(),
                "empty".to_string(),
            ));
        }
        let shards: BTreeSet<&String> = index.weight_map.values().collect();
        let mut files: Vec<MappedFile> = Vec::with_capacity(shards.len());
        let mut location: BTreeMap<String, usize> = BTreeMap::new();
        for shard in shards {
            let mut components = Path::new(shard.as_str()).components();
            let plain = matches!(
                (components.next(), components.next()),
                (Some(Component::Normal(_)), None)
            );
            if !plain {
                return Err(index_err(
                    "a shard's name".to_string(),
                    "a plain file name: shards must lie in the model directory".to_string(),
                    format!("`{shard}`"),
                ));
            }
            let file = MappedFile::open(&dir.join(shard))?;
            for name in file.names() {
                if let Some(&first) = location.get(&name) {
                    return Err(Error::Invalid {
                        path: Some(file.path.clone()),
                        what: format!("tensor `{name}`"),
                        expected: "each tensor in one shard only".to_string(),
                        got: format!("also in {}", files[first].path.display()),
                    });
                }
                location.insert(name, files.len());
            }
            files.push(file);
        }
        for (name, shard) in &index.weight_map {
            let found = location.get(name).map(|&i| &files[i].path);
            if found != Some(&dir.join(shard)) {
                return Err(index_err(
                    format!("tensor `{name}`"),
                    format!("in shard `{shard}`, where the index lists it"),
                    found.map_or(
                        "in none of the shards the index lists".to_string(),
                        |path| format!("in {}", path.display()),
                    ),
                ));
            }
        }
        Ok(Self { files, location })
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.location.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.location.is_empty()
    }

    /// One tensor as stored, or `None` when the checkpoint has no tensor of that name.
    pub fn get(&self, name: &str) -> Option<StoredTensor<'_>> {
        self.files[*self.location.get(name)?].tensor(name)
    }

    /// The `__metadata__` map of the file holding `name` (`format: "pt"` for files
    /// `transformers` writes, and [`write_safetensors`] too).
    pub fn metadata_of(&self, name: &str) -> Option<&HashMap<String, String>> {
        self.files[*self.location.get(name)?]
            .metadata
            .metadata()
            .as_ref()
    }
}

/// A [`TensorData`] seen as a safetensors [`View`].
struct DataView<'a> {
    data: &'a TensorData,
    dtype: Dtype,
}

impl View for DataView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.data.shape.as_slice()
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        self.data.as_bytes().into()
    }

    fn data_len(&self) -> usize {
        self.data.as_bytes().len()
    }
}

/// Writes tensors to one safetensors file, each in the dtype its [`TensorData`] holds (F32, F16
/// or BF16), with the `__metadata__` `{"format": "pt"}` that `transformers` expects.
///
/// The file is written to a temporary sibling and renamed into place, so an interrupted write
/// never leaves a partial file under `path`.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, TensorData>) -> Result<(), Error> {
    write_safetensors_with_metadata(path, tensors, HashMap::new())
}

/// [`write_safetensors`] with more `__metadata__` entries besides `format: "pt"` (a
/// `format` among them replaces it): strings a reader finds with [`Checkpoint::metadata_of`].
pub fn write_safetensors_with_metadata(
    path: &Path,
    tensors: &BTreeMap<String, TensorData>,
    extra: HashMap<String, String>,
) -> Result<(), Error> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, data) in tensors {
        let dtype =
            stored_dtype(data.dtype).ok_or_else(|| unsupported_dtype(path, name, data.dtype))?;
        views.push((name.as_str(), DataView { data, dtype }));
    }
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp_path = path.with_file_name(format!(".{file_name}.tmp"));
    let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    metadata.extend(extra);
    let written = safetensors::serialize_to_file(views, Some(metadata), &tmp_path)
        .map_err(|e| match e {
            SafeTensorError::IoError(source) => Error::Io {
                action: "write the safetensors file",
                path: tmp_path.clone(),
                source,
            },
            e => invalid(path, "the data written", e),
        })
        .and_then(|()| {
            fs::rename(&tmp_path, path).map_err(Error::io("rename the written file to", path))
        });
    if written.is_err() {
        // Best effort: the temporary file may not exist if creating it failed.
        let _ = fs::remove_file(&tmp_path);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use distflash_test_support::TempDir;
    use half::bf16;

    fn f32_data(shape: &[usize], values: &[f32]) -> TensorData {
        TensorData::new(values.to_vec(), shape.to_vec())
    }

    fn bf16_data(shape: &[usize], values: &[f32]) -> TensorData {
        f32_data(shape, values).convert_dtype(DType::BF16)
    }

    #[test]
    fn round_trip_keeps_dtype_bytes_and_writes_format_pt() {
        let tmp = TempDir::new("round-trip");
        let path = tmp.path().join("w.safetensors");
        let tensors = BTreeMap::from([
            (
                "a".to_string(),
                f32_data(&[2, 3], &[1.0, -2.5, 3.0, 0.1, 5.0, 6.0]),
            ),
            ("b".to_string(), bf16_data(&[3], &[0.1, 1e-3, -7.0])),
            (
                "c".to_string(),
                f32_data(&[2], &[1.5, 2.0]).convert_dtype(DType::F16),
            ),
        ]);
        write_safetensors(&path, &tensors).unwrap();
        let checkpoint = Checkpoint::open_file(&path).unwrap();
        assert_eq!(checkpoint.names().collect::<Vec<_>>(), ["a", "b", "c"]);
        for (name, data) in &tensors {
            let stored = checkpoint.get(name).unwrap();
            assert_eq!(stored.dtype, data.dtype, "{name}");
            assert_eq!(stored.shape, data.shape.as_slice(), "{name}");
            assert_eq!(stored.bytes, data.as_bytes(), "{name}");
            assert_eq!(&stored.to_data(), data, "{name}");
        }
        let b = checkpoint.get("b").unwrap().to_data();
        assert_eq!(b.as_slice::<bf16>().unwrap()[2], bf16::from_f32(-7.0));
        let metadata = checkpoint.metadata_of("a").unwrap();
        assert_eq!(metadata.get("format").map(String::as_str), Some("pt"));
        assert!(checkpoint.get("absent").is_none());
        assert!(!tmp.path().join(".w.safetensors.tmp").exists());
    }

    fn write_index(dir: &Path, map: &[(&str, &str)]) {
        let map: BTreeMap<&str, &str> = map.iter().copied().collect();
        let json = serde_json::json!({ "metadata": {}, "weight_map": map });
        fs::write(dir.join(INDEX_FILE_NAME), json.to_string()).unwrap();
    }

    #[test]
    fn shards_listed_in_an_index_are_read_and_checked() {
        let tmp = TempDir::new("shards");
        let dir = tmp.path();
        let one = BTreeMap::from([("x".to_string(), f32_data(&[1], &[1.0]))]);
        let two = BTreeMap::from([("y".to_string(), bf16_data(&[2], &[2.0, 3.0]))]);
        write_safetensors(&dir.join("s1.safetensors"), &one).unwrap();
        write_safetensors(&dir.join("s2.safetensors"), &two).unwrap();
        write_index(dir, &[("x", "s1.safetensors"), ("y", "s2.safetensors")]);
        let checkpoint = Checkpoint::open_dir(dir).unwrap();
        assert_eq!(checkpoint.len(), 2);
        assert_eq!(checkpoint.get("y").unwrap().dtype, DType::BF16);

        write_index(dir, &[("x", "s2.safetensors"), ("y", "s2.safetensors")]);
        let e = Checkpoint::open_dir(dir).err().unwrap();
        assert!(
            matches!(e, Error::Invalid { ref what, ref expected, ref got, .. }
                if what == "tensor `x`"
                    && expected.starts_with("in shard `s2.safetensors`")
                    && got == "in none of the shards the index lists"),
            "{e}"
        );

        write_index(dir, &[("x", "../s1.safetensors")]);
        let e = Checkpoint::open_dir(dir).err().unwrap().to_string();
        assert!(e.contains("expected a plain file name"), "{e}");

        write_safetensors(&dir.join("s2.safetensors"), &one).unwrap();
        write_index(dir, &[("x", "s1.safetensors"), ("y", "s2.safetensors")]);
        let e = Checkpoint::open_dir(dir).err().unwrap();
        assert!(
            matches!(e, Error::Invalid { ref what, ref got, .. }
                if what == "tensor `x`" && got.starts_with("also in")),
            "{e}"
        );

        fs::write(dir.join(INDEX_FILE_NAME), "{\"weight_map\": 3}").unwrap();
        let e = Checkpoint::open_dir(dir).err().unwrap().to_string();
        assert!(e.contains("weight_map"), "{e}");
    }

    #[test]
    fn missing_truncated_and_unsupported_files_are_errors() {
        let tmp = TempDir::new("bad");
        let e = Checkpoint::open_dir(tmp.path()).err().unwrap();
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        assert!(e.to_string().contains(INDEX_FILE_NAME), "{e}");

        let path = tmp.path().join(SINGLE_FILE_NAME);
        let tensors = BTreeMap::from([("x".to_string(), f32_data(&[4], &[1.0; 4]))]);
        write_safetensors(&path, &tensors).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let e = Checkpoint::open_dir(tmp.path()).err().unwrap().to_string();
        assert!(e.contains("is not a valid safetensors file"), "{e}");
        fs::write(&path, [1u8, 2]).unwrap();
        assert!(Checkpoint::open_file(&path).is_err());

        let ints = BTreeMap::from([("i".to_string(), TensorData::new(vec![1i64, 2], [2]))]);
        let e = write_safetensors(&path, &ints).unwrap_err().to_string();
        assert!(e.contains("tensor `i`") && e.contains("I64"), "{e}");
        // An I64 tensor written by another tool is refused on reading, by name.
        let view = safetensors::tensor::TensorView::new(Dtype::I64, vec![1], &[0u8; 8]).unwrap();
        safetensors::serialize_to_file([("ids", view)], None, &path).unwrap();
        let e = Checkpoint::open_file(&path).err().unwrap().to_string();
        assert!(e.contains("tensor `ids`") && e.contains("I64"), "{e}");
    }
}
