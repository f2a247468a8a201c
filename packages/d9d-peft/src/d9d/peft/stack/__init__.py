"""Several PEFT methods applied in order."""

from d9d.peft.stack.method import PeftStack

__all__ = ["PeftStack"]
