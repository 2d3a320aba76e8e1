"""DeePMD-kit's plugin entry point (groups ``deepmd.pt`` and
``deepmd.pt_expt``, python/pyproject.toml): loaded when DeePMD-kit imports its
PyTorch backend; installs the mixstack drop-in if ``MIXSTACK_DEEPMD`` asks for
it (mixstack_torch.deepmd)."""

from .deepmd import from_environment

from_environment()
