"""A private loader for prebuilt binaries that need a newer glibc than the host's.

PyPI's ``perf-analyzer`` wheels (manylinux_2_38) need glibc 2.38 and GLIBCXX
3.4.32; Debian 12 has 2.36. Nothing on the host is changed: Debian 13's
``libc6``, ``libstdc++6`` and ``libgcc-s1`` are fetched with ``apt-get download``
through a private apt configuration (the host's own Debian archive, another
suite, lists and packages kept in the cache directory), unpacked with
``dpkg-deb -x``, and the binary is started by that glibc's ``ld-linux`` with
``--library-path``: the new libc and libstdc++ first, the host's libraries (zlib,
OpenSSL) after them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# Debian 13: glibc 2.41, libstdc++ from GCC 14 (GLIBCXX_3.4.33).
SUITE = "trixie"
PACKAGES = ("libc6", "libstdc++6", "libgcc-s1")
DEFAULT_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
_MISSING = re.compile(r"version `(GLIBC\w*_[\d.]+)' not found")


class Unavailable(Exception):
    """The private loader cannot be set up here (no apt, no Debian archive, ...)."""


def missing_versions(command: list[str]) -> list[str]:
    """The symbol versions the host's loader reports missing when starting
    ``command`` (empty when it starts)."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise Unavailable(f"cannot run {command[-1]}: {exc}") from None
    return sorted(set(_MISSING.findall(done.stderr)))


def is_elf(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _host_archive() -> tuple[str, str]:
    """The host's Debian archive (URI, keyring) from its apt sources: the entry
    whose suite is the host's release, so that the newer suite comes from the
    same mirror the host already uses."""
    release = {}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            key, _, value = line.partition("=")
            release[key] = value.strip('"')
    except OSError:
        pass
    codename = release.get("VERSION_CODENAME", "")
    if release.get("ID") != "debian" or not codename:
        raise Unavailable(
            f"the host is not Debian (os-release ID {release.get('ID')!r}): no Debian "
            "archive to fetch a newer glibc from"
        )
    sources = Path("/etc/apt/sources.list.d")
    files = [Path("/etc/apt/sources.list"), *sorted(sources.glob("*.sources"))]
    files += sorted(sources.glob("*.list"))
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":  # deb822 stanzas
            for stanza in re.split(r"\n\s*\n", text):
                fields = {}
                for line in stanza.splitlines():
                    key, sep, value = line.partition(":")
                    if sep and not line.startswith((" ", "#")):
                        fields[key.strip().lower()] = value.strip()
                if (
                    codename in fields.get("suites", "").split()
                    and "deb" in fields.get("types", "").split()
                ):
                    uri = fields.get("uris", "").split()
                    if uri:
                        return uri[0], fields.get("signed-by", DEFAULT_KEYRING)
        else:  # one-line format: deb [options] URI suite components
            for line in text.splitlines():
                words = re.sub(r"\[[^]]*\]", "", line).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == codename:
                    return words[1], DEFAULT_KEYRING
    raise Unavailable(f"no apt source for Debian {codename!r} to take the archive's address from")


class PrivateGlibc:
    """Debian 13's glibc and libstdc++ unpacked under ``cache``/glibc-trixie,
    fetched once; :meth:`prefix` is the command prefix that runs a binary with them."""

    def __init__(self, cache: Path) -> None:
        self.root = cache / f"glibc-{SUITE}"

    def prefix(self, log=print) -> list[str]:
        loader = self._loader()
        if loader is None:
            self._fetch(log)
            loader = self._loader()
            if loader is None:
                raise Unavailable(f"no ld-linux in the unpacked {', '.join(PACKAGES)}")
        libdir = loader.parent
        host = [f"/lib/{libdir.name}", f"/usr/lib/{libdir.name}"]
        return [str(loader), "--library-path", ":".join([str(libdir), *host])]

    def _loader(self) -> Path | None:
        found = sorted((self.root / "root" / "usr" / "lib").glob("*-linux-gnu*/ld-linux*.so.*"))
        return found[0] if found else None

    def _fetch(self, log) -> None:
        uri, keyring = _host_archive()
        apt = self.root / "apt"
        for folder in (apt / "lists" / "partial", apt / "cache" / "archives" / "partial"):
            folder.mkdir(parents=True, exist_ok=True)
        debs = self.root / "debs"
        debs.mkdir(exist_ok=True)
        sources = apt / "sources.list"
        sources.write_text(f"deb [signed-by={keyring}] {uri} {SUITE} main\n")
        options = [
            "-q",
            "-o", f"Dir::Etc::SourceList={sources}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={apt / 'lists'}",
            "-o", f"Dir::Cache={apt / 'cache'}",
            "-o", "Dir::State::status=/dev/null",
            "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        log(f"fetching Debian {SUITE}'s {', '.join(PACKAGES)} with apt-get download ...")
        for step in (["update"], ["download", *PACKAGES]):
            try:
                done = subprocess.run(
                    ["apt-get", *options, *step],
                    cwd=debs,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise Unavailable(f"apt-get {step[0]}: {exc}") from None
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if line.startswith("E:")]
                raise Unavailable(
                    f"apt-get {step[0]} failed: {'; '.join(lines) or done.stderr[-300:]}"
                )
        unpacked = self.root / "root"
        for deb in sorted(debs.glob("*.deb")):
            done = subprocess.run(
                ["dpkg-deb", "-x", str(deb), str(unpacked)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise Unavailable(f"dpkg-deb -x {deb.name} failed: {done.stderr[-300:]}")
