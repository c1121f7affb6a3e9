"""The repository speaks of the library, not of how it was made: no tracker numbers, no
remarks on which machine whoever ran a figure had, no tool folders, and no citation of
a file the reader does not have (papers are cited by authors, venue and year)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each pattern is built from pieces so that this file does not match itself.
FORBIDDEN = {
    'a tracker issue number': r'(?i)\bissues?\s*\(?#?\s*\d+',
    'a machine lent or not to whoever ran something': (
        r'(?i)\b(len' r't|borrow' r'ed)\b|no GPU w' r'as|GPU was not|w' r'as not available'),
    'a session of whoever worked on it': r'(?i)\b(this|last|that|earlier|the) sessi' r'ons?\b',
    'history narration': r'(?i)before this chan' r'ge|after this chan' r'ge',
    "a tool's return folder": r'\$' r'OUT\b',
    'a file the reader does not have': (
        r'\b(atp|fedtta_upfl|fedicon|fedevolve|fedins)\.t' r'xt\b|REFERENCE\.m' r'd|DESIGN\.m' r'd|'
        r'\.\./sha' r'red'),
}


def tracked_text_files():
  files = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
  for name in files:
    path = os.path.join(ROOT, name)
    if name.endswith(('.png', '.npz', '.gz')) or not os.path.isfile(path):
      continue
    try:
      with open(path, encoding='utf-8') as f:
        yield name, f.read()
    except UnicodeDecodeError:
      continue


def test_no_tracked_file_speaks_of_how_the_library_was_made():
  found = []
  for name, text in tracked_text_files():
    if name == 'tests/test_text.py':   # its own examples
      continue
    for what, pattern in FORBIDDEN.items():
      for match in re.finditer(pattern, text):
        line = text.count('\n', 0, match.start()) + 1
        found.append(f'{name}:{line}: {what}: {match.group()!r}')
  assert not found, '\n'.join(found)


@pytest.mark.parametrize('text, what', [
    ('see issue 12', 'a tracker issue number'),
    ('No GPU w' 'as lent', 'a machine lent or not to whoever ran something'),
    ('written to $' 'OUT', "a tool's return folder"),
    ('fedtta_upfl.t' 'xt Sec. 3', 'a file the reader does not have'),
])
def test_the_patterns_catch_what_they_name(text, what):
  assert re.search(FORBIDDEN[what], text)
