"""Stand-in of verifiers' `bash` harness: it hands the model a shell (refused by posttrain)."""

from typing import ClassVar

from verifiers.v1 import Harness, HarnessConfig

__all__ = ["BashHarness"]


class BashHarness(Harness[HarnessConfig]):
    EXECUTES_CODE: ClassVar[bool] = True
