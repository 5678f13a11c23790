"""Stand-in of verifiers/v1/harnesses/utils/launch.py: the chat program (a PEP 723 script
whose `main()` makes one streamed chat call) and `launch_chat_program` (argv, then the
runtime prepares and runs it). Where the real program's calls go through verifiers'
interception server, which adds the episode's headers and records the reply, this one
is handed the headers (`--header`) and the sampling's keys to impose on the body
(`--body`), and writes its reply to `--reply-file`."""

import json
from typing import Any

CHAT_PROGRAM_SOURCE = """# /// script
# dependencies = ["httpx"]
# ///
import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--system-prompt", default="")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--initial-messages-file", default="")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--body", default="{}")
    parser.add_argument("--reply-file", required=True)
    return parser.parse_args()


async def main():
    args = parse_args()
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    if args.initial_messages_file:
        path = Path(args.initial_messages_file)
        messages += json.loads(path.read_bytes())
        path.unlink()
    elif args.prompt:
        messages.append({"role": "user", "content": args.prompt})
    headers = dict(h.split(":", 1) for h in args.header)
    headers["Authorization"] = f"Bearer {args.api_key}"
    body = {"model": args.model, "messages": messages, "stream": True, **json.loads(args.body)}
    reply = ""
    async with httpx.AsyncClient(timeout=120) as client:
        url = f"{args.base_url}/chat/completions"
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                print(await r.aread(), file=sys.stderr)
                raise SystemExit(97)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        reply += c["delta"].get("content") or ""
    Path(args.reply_file).write_text(reply)


if __name__ == "__main__":
    asyncio.run(main())
"""


async def launch_chat_program(source, config, ctx, trace, runtime, endpoint, secret, data) -> Any:
    """Run the chat program for one episode segment (as the real one: argv, an initial
    messages file in the runtime's directory for a Messages prompt, prepare, run)."""
    args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
    args += [f"--header={k}:{v}" for k, v in ctx.client.headers.items()]
    args.append(f"--body={json.dumps(ctx.sampling.model_dump(exclude_none=True))}")
    args.append(f"--reply-file={runtime.workdir / 'reply.txt'}")
    if data.system_prompt:
        args.append(f"--system-prompt={data.system_prompt}")
    if isinstance(data.prompt, str):
        args.append(f"--prompt={data.prompt}")
    elif data.prompt is not None:
        path = ".vf-initial-messages.json"
        await runtime.write(path, json.dumps(list(data.prompt)).encode())
        args.append(f"--initial-messages-file={path}")
    program = await runtime.prepare_uv_script(source, config.resolved_env)
    return await runtime.run_program([*program, *args], dict(config.resolved_env))
