"""The botocore session of the S3 store, and the endpoint it resolves: both read a given ``environ``;
what an endpoint URL may be, and whether the environment sends a URL through a proxy.

``aws_session`` builds a session whose configuration chain (profile, config and credentials file
paths, region, ...) and environment credential provider read the mapping it is given instead of
``os.environ`` (see ``tiering.objectstore.s3``, "Credentials and environ"); ``configured_endpoint_url``
resolves, once, the endpoint such a session would use. ``S3ObjectStore`` and the CLI import them from
``tiering.objectstore.s3``, which re-exports them.
"""

from __future__ import annotations

import urllib.request
from typing import Mapping
from urllib.parse import urlsplit

import botocore.exceptions as bexc
from aiobotocore.credentials import AioEnvProvider
from aiobotocore.session import AioSession
from botocore.configprovider import ConfigChainFactory, ConfiguredEndpointProvider

from tiering.objectstore.s3presign import fast_timestamp

__all__ = ["aws_session", "configured_endpoint_url"]


def aws_session(environ: Mapping[str, str]) -> AioSession:
    """A botocore session whose configuration chain and env credential provider read ``environ``."""
    env = dict(environ)
    session = AioSession()
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=fast_timestamp)
    factory = ConfigChainFactory(session=session, environ=env)
    store = session.get_component("config_store")
    for name, (config_name, env_vars, default, typecast) in AioSession.SESSION_VARIABLES.items():
        store.set_config_provider(name, factory.create_config_chain(
            instance_name=name, env_var_names=env_vars, config_property_names=config_name,
            default=default, conversion_func=typecast,
        ))
    resolver = session.get_component("credential_provider")
    imds_disabled = env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    resolver.providers = [
        AioEnvProvider(environ=env) if p.METHOD == "env" else p
        for p in resolver.providers
        if not (imds_disabled and p.METHOD == "iam-role")  # botocore would read this from os.environ
    ]
    return session


def configured_endpoint_url(environ: Mapping[str, str]) -> str | None:
    """The S3 endpoint botocore would use for a client given none, from ``environ`` and the AWS config
    file it names: ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``, then the profile's ``services``
    section's ``s3.endpoint_url``, then its ``endpoint_url``; None where none is set or
    ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``/``ignore_configured_endpoint_urls`` is true (AWS's order for
    service-specific endpoints, read by botocore's own provider over ``environ``).

    Resolved once, here, so that the source's identity (``cachefs.settings.source_identity``: its cache
    directory and cluster-tier keys) names the server the store talks to: the store passes this URL to
    its client, and a store without one tells botocore to ignore configured endpoints (issue 34:
    ``AWS_ENDPOINT_URL_S3`` was used by botocore and missing from the identity, so another server's
    data was cached and shared as the AWS bucket's). ``ValueError`` for a config file that names a
    ``services`` section it does not have."""
    session = aws_session(environ)
    try:
        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return None
        url = ConfiguredEndpointProvider(full_config=session.full_config, scoped_config=session.get_scoped_config(),
                                         client_name="s3", environ=dict(environ)).provide()
    except (bexc.InvalidConfigError, bexc.ProfileNotFound, bexc.ConfigParseError) as exc:
        raise ValueError(f"the AWS config file: {exc}") from None
    return str(url) if url else None


def check_endpoint(endpoint_url: str) -> None:
    """A ``ValueError`` for an endpoint URL that is not plain http(s)://host[:port]."""
    parts = urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("S3 endpoint URL must be http(s)://host[:port]")
    if parts.username is not None or parts.password is not None:
        raise ValueError("S3 endpoint URL must not contain user info or credentials")
    if parts.query or parts.fragment:
        raise ValueError("S3 endpoint URL must not have a query string or fragment")


def proxied(url: str) -> bool:
    """Whether the environment routes requests for ``url`` through a proxy (HTTP(S)_PROXY, NO_PROXY)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if parts.scheme not in proxies and "all" not in proxies:
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")
