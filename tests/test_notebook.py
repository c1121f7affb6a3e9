"""examples/quickstart.ipynb: the README's "From Python" examples as a notebook (run,
load, evaluate, ATP's α gradient, a model of one's own), executed from another
directory so that it cannot rot. Its code cells are the README's blocks, each workdir
under a temporary folder; after editing those blocks, rewrite it with
``python -c "import sys; sys.path.insert(0, 'tests'); import test_notebook; test_notebook.write()"``.
"""
import os

from test_load_run import readme_python_examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, 'examples', 'quickstart.ipynb')
INTRO = ('# fedjax_shift from a notebook\n\n'
         'A federated run trained, loaded back and evaluated; the gradient of a test-time '
         "loss with respect to ATP's per-module adaptation rates α; a model and data of "
         "your own through the compiled round and a test-time adapter. These are the "
         "README's \"From Python\" examples, each workdir under a temporary folder; the "
         "configs load from any directory after `pip install -e .`.")
HEADINGS = ('## A run, back in Python, and its evaluation',
            "## ATP's α: a pytree you can differentiate through",
            '## A model and data of your own')
WORKDIRS = {'/tmp/fedjax_shift_python': 'python', '/tmp/fedjax_shift_atp': 'atp'}


def notebook_cells():
  """[(kind, source)] of the notebook, from the README's blocks."""
  cells = [('markdown', INTRO), ('code', "import os, tempfile\n"
                                         "workdir = tempfile.mkdtemp(prefix='fedjax_shift_')")]
  for heading, block in zip(HEADINGS, readme_python_examples()):
    for path, name in WORKDIRS.items():
      block = block.replace(f"'{path}'", f"os.path.join(workdir, '{name}')")
    cells += [('markdown', heading), ('code', block.rstrip('\n'))]
  return cells


def write() -> None:
  """Writes examples/quickstart.ipynb from the README (no outputs)."""
  import nbformat
  notebook = nbformat.v4.new_notebook()
  notebook.cells = [nbformat.v4.new_markdown_cell(source, id=f'cell-{index}')
                    if kind == 'markdown' else nbformat.v4.new_code_cell(source, id=f'cell-{index}')
                    for index, (kind, source) in enumerate(notebook_cells())]
  notebook.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3',
                                     'language': 'python'}
  nbformat.write(notebook, NOTEBOOK)


def test_the_notebook_is_the_readmes_examples():
  import nbformat
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert [(cell.cell_type, cell.source) for cell in notebook.cells] == notebook_cells(), \
      'examples/quickstart.ipynb differs from the README: rewrite it (module docstring)'
  assert not any(cell.get('outputs') for cell in notebook.cells)   # committed without outputs


def test_the_notebook_runs_from_another_directory(tmp_path):
  import nbclient   # the dev extra's
  import nbformat
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(notebook, timeout=900, kernel_name='python3',
                          resources={'metadata': {'path': str(tmp_path)}}).execute()
  printed = ''.join(output.get('text', '') for cell in notebook.cells
                    for output in cell.get('outputs', ()))
  assert 'client 0 train accuracy' in printed and 'tent accuracy per client' in printed
