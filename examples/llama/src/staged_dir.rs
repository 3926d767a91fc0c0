//! [`StagedDir`]: a directory replaced whole. Its new contents are written into a sibling
//! staging directory (`.NAME.partial`), which then takes the directory's place by two renames:
//! the old directory to `.NAME.old`, the staging one to `NAME`; the old one is then removed.
//! A crash while the contents are written leaves the directory as it was (and a stale staging
//! directory, cleared by the next save); a crash between the renames leaves no `NAME` but both
//! complete versions beside it, which [`StagedDir::leftovers`] finds.

use std::fs;
use std::path::{Path, PathBuf};

use crate::Error;

/// The directory to replace and its two siblings.
pub(crate) struct StagedDir {
    dir: PathBuf,
    staging: PathBuf,
    old: PathBuf,
}

impl StagedDir {
    /// The staging of `dir`'s replacement (nothing is touched yet).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a path without a final name (`/`, `..`).
    pub(crate) fn new(dir: &Path) -> Result<Self, Error> {
        let name = dir.file_name().ok_or_else(|| Error::Invalid {
            path: Some(dir.to_path_buf()),
            what: "the checkpoint directory".into(),
            expected: "a path ending in a directory name".into(),
            got: "a path without one".into(),
        })?;
        let sibling =
            |suffix: &str| dir.with_file_name(format!(".{}.{suffix}", name.to_string_lossy()));
        Ok(Self {
            dir: dir.to_path_buf(),
            staging: sibling("partial"),
            old: sibling("old"),
        })
    }

    /// Where the new contents go.
    pub(crate) fn staging(&self) -> &Path {
        &self.staging
    }

    /// Clears any stale staging directory and creates an empty one (and the parents).
    pub(crate) fn prepare(&self) -> Result<(), Error> {
        if self.staging.exists() {
            fs::remove_dir_all(&self.staging).map_err(Error::io(
                "remove the stale staging directory",
                &self.staging,
            ))?;
        }
        fs::create_dir_all(&self.staging)
            .map_err(Error::io("create the staging directory", &self.staging))
    }

    /// Puts the staging directory in the directory's place and removes the old contents.
    pub(crate) fn commit(&self) -> Result<(), Error> {
        if self.old.exists() {
            fs::remove_dir_all(&self.old)
                .map_err(Error::io("remove the stale previous directory", &self.old))?;
        }
        if self.dir.exists() {
            fs::rename(&self.dir, &self.old)
                .map_err(Error::io("move the previous contents aside to", &self.old))?;
        }
        fs::rename(&self.staging, &self.dir)
            .map_err(Error::io("move the new contents into place at", &self.dir))?;
        // Best effort: the new contents are in place; a leftover is removed by the next commit.
        let _ = fs::remove_dir_all(&self.old);
        Ok(())
    }

    /// The siblings an interrupted replacement of `dir` left (staging or previous contents),
    /// for error messages.
    pub(crate) fn leftovers(dir: &Path) -> Vec<PathBuf> {
        Self::new(dir).map_or_else(
            |_| Vec::new(),
            |s| {
                [s.old, s.staging]
                    .into_iter()
                    .filter(|p| p.is_dir())
                    .collect()
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distflash_test_support::TempDir;

    #[test]
    fn the_directory_holds_the_old_or_the_new_contents() {
        let tmp = TempDir::new("staged");
        let dir = tmp.path().join("checkpoint");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("a"), "old").unwrap();
        let staged = StagedDir::new(&dir).unwrap();
        staged.prepare().unwrap();
        fs::write(staged.staging().join("b"), "new").unwrap();
        // Before the commit the directory is untouched; a second prepare clears the staging.
        assert_eq!(fs::read_to_string(dir.join("a")).unwrap(), "old");
        assert_eq!(
            StagedDir::leftovers(&dir),
            vec![tmp.path().join(".checkpoint.partial")]
        );
        staged.prepare().unwrap();
        assert!(!staged.staging().join("b").exists());
        fs::write(staged.staging().join("b"), "new").unwrap();
        staged.commit().unwrap();
        assert!(!dir.join("a").exists());
        assert_eq!(fs::read_to_string(dir.join("b")).unwrap(), "new");
        assert!(StagedDir::leftovers(&dir).is_empty());
        // A directory that does not exist yet is created by the commit.
        let fresh = StagedDir::new(&tmp.path().join("x/y")).unwrap();
        fresh.prepare().unwrap();
        fresh.commit().unwrap();
        assert!(tmp.path().join("x/y").is_dir());
        assert!(StagedDir::new(Path::new("/")).is_err());
    }
}
