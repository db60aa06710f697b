"""``pd-router``: serve one PDService's OpenAI endpoint in front of its prefill and decode engines."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from pdconnector.router.app import RouterOptions, create_app
from pdconnector.router.config import load_router_config
from pdconnector.router.health import HealthSettings
from pdconnector.router.logs import configure_logging
from pdconnector.router.proxy import Dispatch

log = logging.getLogger("pdconnector.router")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-router", description=__doc__)
    parser.add_argument(
        "--config", type=Path, required=True, help="router.yaml written by the operator (watched for changes)"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument(
        "--port", type=int, default=None, help="listen port (default: the config's listen_port)"
    )
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    parser.add_argument(
        "--dispatch",
        choices=[d.value for d in Dispatch],
        default=None,
        help="override the config's mode (push-sequential: benchmarks only)",
    )
    parser.add_argument(
        "--total-timeout", type=float, default=600.0, help="deadline of a whole request, seconds"
    )
    parser.add_argument(
        "--health-interval", type=float, default=2.0, help="seconds between active health checks"
    )
    parser.add_argument(
        "--health-timeout",
        type=float,
        default=1.0,
        help="seconds a health check waits for an answer (two missed in a row eject the engine)",
    )
    parser.add_argument(
        "--refresh-interval", type=float, default=2.0, help="seconds between config/DNS refreshes"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    try:
        config = load_router_config(args.config)
    except (OSError, ValueError) as error:
        print(f"pd-router: cannot load {args.config}: {error}", file=sys.stderr)
        return 2
    api_key = None
    if config.api_key_env is not None:
        api_key = os.environ.get(config.api_key_env)
        if not api_key:
            print(
                f"pd-router: the config requires an API key but ${config.api_key_env} is empty",
                file=sys.stderr,
            )
            return 2
    options = RouterOptions(
        config_path=args.config,
        dispatch=Dispatch(args.dispatch) if args.dispatch else None,
        total_timeout_s=args.total_timeout,
        refresh_interval_s=args.refresh_interval,
        health=HealthSettings(interval_s=args.health_interval, timeout_s=args.health_timeout),
        api_key=api_key,
    )
    port = args.port if args.port is not None else config.listen_port
    log.info(
        "pd-router starting",
        extra={
            "host": args.host,
            "port": port,
            "model": config.served_model_name,
            "mode": options.dispatch or config.mode,
        },
    )
    web.run_app(
        create_app(config, options),
        host=args.host,
        port=port,
        handler_cancellation=True,
        print=None,
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
