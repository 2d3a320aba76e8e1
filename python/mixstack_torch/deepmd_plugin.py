"""DeePMD-kit's plugin entry point (groups ``deepmd.pt`` and
``deepmd.pt_expt``, python/pyproject.toml): loaded when DeePMD-kit imports its
PyTorch backend; installs the mixstack drop-in if ``MIXSTACK_DEEPMD`` asks for
it (mixstack_torch.deepmd)."""

import os

# With the switch unset this does nothing more than import the package, whose
# failure to load the ops' library is a warning (__init__.py), never an
# error that would stop DeePMD-kit's import.
if os.environ.get("MIXSTACK_DEEPMD", "").strip():
    from .deepmd import from_environment

    from_environment()
