"""The presets' names, without torch, so that the command line can offer them in ``--help`` cheaply;
:mod:`dsa.model.presets` defines one config factory for each (and checks that the two agree)."""

PRESET_NAMES = ("tiny", "demo-cpu", "demo-gpu", "glm-skip-small")
