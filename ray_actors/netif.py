"""Which network interface carries an address: :func:`interface_of`.

gloo (``GLOO_SOCKET_IFNAME``) and NVSHMEM's unique-id bootstrap (``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME``)
choose their sockets by interface name, while Ray reports each node by address. A team across nodes binds
those sockets to the interface holding the address Ray reports for the rank's node, read from the
C library's ``getifaddrs`` (every address of every interface, IPv4 and IPv6; Linux layout).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
import sys

__all__ = ["interface_of", "interface_addresses"]


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("sin_family", ctypes.c_ushort), ("sin_port", ctypes.c_uint16), ("sin_addr", ctypes.c_ubyte * 4)]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [("sin6_family", ctypes.c_ushort), ("sin6_port", ctypes.c_uint16), ("sin6_flowinfo", ctypes.c_uint32),
                ("sin6_addr", ctypes.c_ubyte * 16), ("sin6_scope_id", ctypes.c_uint32)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.POINTER(_Sockaddr)),
                     ("ifa_netmask", ctypes.POINTER(_Sockaddr)), ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
                     ("ifa_data", ctypes.c_void_p)]


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """``(interface name, address)`` for every IPv4 and IPv6 address of this machine's interfaces."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"listing interfaces needs Linux's getifaddrs layout (this is {sys.platform})")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs: {os.strerror(errno)}")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.ifa_addr:
                family = item.ifa_addr.contents.sa_family
                name = item.ifa_name.decode(errors="replace")
                if family == socket.AF_INET:
                    raw = ctypes.cast(item.ifa_addr, ctypes.POINTER(_SockaddrIn)).contents.sin_addr
                    found.append((name, ipaddress.IPv4Address(bytes(raw))))
                elif family == socket.AF_INET6:
                    raw = ctypes.cast(item.ifa_addr, ctypes.POINTER(_SockaddrIn6)).contents.sin6_addr
                    found.append((name, ipaddress.IPv6Address(bytes(raw))))
            entry = item.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_of(address: str) -> str:
    """The name of the interface holding ``address`` on this machine.

    Raises:
        ValueError: ``address`` is not an IP address, or no interface here holds it (the message lists the
            interfaces and says how to choose one by hand).
    """
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"address={address!r}: not an IP address") from None
    addresses = interface_addresses()
    for name, held in addresses:
        if held == wanted:
            return name
    listed = ", ".join(f"{name} {held}" for name, held in addresses) or "none"
    raise ValueError(f"address={address}: no interface of this machine holds it (interfaces: {listed}); set "
                     "GLOO_SOCKET_IFNAME / NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME on the nodes to choose one")
