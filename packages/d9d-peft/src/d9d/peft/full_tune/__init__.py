"""Full tune: train every parameter of the selected modules as they are."""

from d9d.peft.full_tune.method import FullTune

__all__ = ["FullTune"]
