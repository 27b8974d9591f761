"""``vmcache heatmap DOMAIN [DISK] -o FILE.png``: a running agent's heat map, on demand.

The agent serves its disks' heat maps beside its metrics
(``/heatmap/<disk>.png`` and ``.json``, same address, TLS and basic auth);
this command finds the agent from its status file and fetches one.
"""

from __future__ import annotations

import argparse
import base64
import os
import ssl
import urllib.error
import urllib.request
from urllib.parse import quote, urlsplit

from ..errors import ConfigError, DomainError, HostError
from ..observe.exporter import basic_auth_credentials
from ..host.files import write_atomic
from ..observe.status import read_status, status_path
from ._host import add_host_options, host_config

NAME = "heatmap"
HELP = "fetch a running agent's heat map of one disk (PNG, or JSON with --json)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", help="libvirt domain name")
    parser.add_argument("disk", nargs="?", help="disk target, e.g. vda (default: the agent's first managed disk)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write it ('-' for stdout)")
    parser.add_argument("--json", action="store_true", help="regions and per-bucket heat as JSON instead of a PNG")
    add_host_options(parser, uri=False)


def run(args: argparse.Namespace) -> int:
    config = host_config(args)
    path = status_path(config.agents_dir, args.domain)
    try:
        status = read_status(path)
    except HostError as err:
        raise DomainError(f"no running vmcache agent for {args.domain!r} ({path})") from err
    except ValueError as err:
        raise DomainError(f"unreadable agent status {path}: {err}") from err
    managed = [d.target for d in status.disks if d.eligible]
    disk = args.disk or (managed[0] if managed else None)
    if disk is None or disk not in managed:
        raise ConfigError("disk", args.disk, f"not managed by the agent (managed: {', '.join(managed) or 'none'})")
    if not status.metrics_url:
        raise DomainError(f"the agent of {args.domain!r} serves no metrics endpoint (see its last error)")
    parts = urlsplit(status.metrics_url)
    url = f"{parts.scheme}://{parts.netloc}/heatmap/{quote(disk)}.{'json' if args.json else 'png'}"
    request = urllib.request.Request(url)
    context = None
    m = config.metrics
    if m.basic_auth is not None:
        credentials = basic_auth_credentials(m.basic_auth)
        request.add_header("Authorization", "Basic " + base64.b64encode(credentials).decode())
    if parts.scheme == "https" and m.tls is not None:
        context = ssl.create_default_context(cafile=m.tls.client_cafile or m.tls.certfile)
        context.check_hostname = False
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            body = resp.read()
    except (urllib.error.URLError, OSError) as err:
        raise HostError(f"cannot fetch {url}: {err}") from err
    if args.output == "-":
        os.write(1, body)
    else:
        write_atomic(args.output, body)
        print(f"{args.domain} {disk}: wrote {args.output} ({len(body)} bytes)")
    return 0
