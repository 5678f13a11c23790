"""Stand-in of verifiers' `null` harness (verifiers/v1/harnesses/null/harness.py): its
chat program prepared by the runtime in `setup`, then started per episode by
`launch_chat_program` on the episode's argv."""

from typing import Any, ClassVar

from verifiers.v1 import Harness, HarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program

__all__ = ["NullHarness"]


class NullHarness(Harness[HarnessConfig]):
    EXECUTES_CODE: ClassVar[bool] = False
    NEEDS_CONTAINER: ClassVar[bool] = False

    async def setup(self, runtime: Any) -> None:
        await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, self.config.resolved_env)

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw) -> Any:
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE, self.config, ctx, trace, runtime, endpoint, secret, data
        )
