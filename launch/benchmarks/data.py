"""Data cases: reading a folder of image files (``data.sources.image_folder``, the
reader of ``data.source='folder:<path>'``, the timed-image benchmarks and the digit
domains' user folders) one file after another, with the library's thread pool, and with
grain's ``DataLoader`` in worker processes (when grain is importable; never a
dependency).
"""
import os
import shutil
import tempfile

import numpy as np

from fedjax_shift.data import sources
from launch.benchmarks import register
from launch.benchmarks.common import FLAGS, timed

# Tiny-ImageNet's shape: 64×64 RGB PNGs, here 2,000 of them in 10 class folders.
IMAGES, SIDE, CLASSES = 2000, 64, 10
READERS = ('serial', 'threads', 'grain')


def write_folder(root: str) -> None:
  """``IMAGES`` random RGB PNGs of ``SIDE`` × ``SIDE`` under ``root/<class>/``."""
  from PIL import Image
  rng = np.random.default_rng(0)
  for c in range(CLASSES):
    os.makedirs(os.path.join(root, f'class_{c}'))
    for i in range(IMAGES // CLASSES):
      pixels = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
      Image.fromarray(pixels).save(os.path.join(root, f'class_{c}', f'{i}.png'))


def grain_reader(root: str):
  """A function reading the folder's files as [N, SIDE, SIDE, 3] through grain's
  DataLoader (``sources.read_workers()`` worker processes, batches of 100), or None
  when grain does not import."""
  try:
    import grain.python as grain
  except ImportError:
    return None
  files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root)
                 for name in names)

  class Files(grain.RandomAccessDataSource):
    def __len__(self):
      return len(files)

    def __getitem__(self, index):
      return sources.read_image(files[index], SIDE, 3)

  def read():
    sampler = grain.IndexSampler(len(files), grain.NoSharding(), shuffle=False, num_epochs=1)
    loader = grain.DataLoader(data_source=Files(), sampler=sampler,
                              operations=[grain.Batch(100)],
                              worker_count=sources.read_workers())
    return np.concatenate(list(loader))
  return read


def case_images(reader: str) -> dict:
  """Seconds to read the folder (median of FLAGS.repeats after one warm-up read, the
  files in the page cache) by ``reader``, and images per second."""
  if reader not in READERS:
    raise ValueError(f'--cases=images:{reader}: choose images:<reader> of {list(READERS)}')
  root = tempfile.mkdtemp(prefix='fedjax_shift_images_')
  try:
    write_folder(root)
    if reader == 'grain':
      read = grain_reader(root)
      if read is None:
        return {'skipped': 'grain is not installed'}
    else:
      workers = 1 if reader == 'serial' else 0
      read = lambda: sources.image_folder(root, SIDE, channels=3, workers=workers).x
    assert read().shape == (IMAGES, SIDE, SIDE, 3)
    median, times = timed(read, FLAGS.repeats)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {'seconds': median, 'times': times, 'compile_s': 0.0,
          'images_per_second': IMAGES / median}


LABELS = {'serial': 'one file after another',
          'threads': f'the library\'s thread pool ({sources.read_workers()} threads)',
          'grain': f'grain DataLoader, {sources.read_workers()} worker processes'}
register('images:', lambda name: f'read {IMAGES:,} {SIDE}×{SIDE} PNGs, '
         f'{LABELS.get(name.split(":")[1], name.split(":")[1])} (s per folder)',
         lambda name: case_images(name.split(':')[1]))
