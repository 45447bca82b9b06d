"""The RAM-disk tier: this node's step folders, written raw and committed atomically.

Import the module that holds what you need:

  format    the on-disk format: layout and constants (MANIFEST, DATA...), the errors
            (LocalTierError, CorruptStepError, ManifestError, AbstractStateMismatchError),
            the manifest records, its parser and `validate_for`
  specs     leaves and their records: PRNG key dtype specs, shard indices, sharding
            descriptions, key paths, `item_metadata`
  checksum  CRC32C through google-crc32c's C library, the GIL released for large buffers
  staging   device-to-host staging, the blocking part of a save (`stage`, `StagedStep`)
  store     the step folders: `LocalTier` (writer, commit, retention, spare reuse),
            `committed_steps`, `read_manifest`, opening a step's files without following links
  read      reading steps back with every checksum checked (`read_step`, `read_data`,
            `arrays_from_buffer`; re-exports `verify`'s names)
  verify    checking a step's bytes against its manifest (`verify_step`, `verify_buffer`)
  lock      one process per local directory (`LocalDirectoryLock`)
  claim     claiming the folder at start-up, agreed across the job (its one collective)
  cast      a restore's dtype casts, made as Orbax makes them (TensorStore's cast driver)
  priority  the background threads' CPU priority below the training loop's (Linux nice)

None of these but `claim` issues a collective: the writer runs safely in a background
thread.
"""
