"""Faults planted in a real toko-api process for tests that need a bug to happen.

``FATAL_WRITER`` is a Python script that runs toko-api (``python SCRIPT``, with
toko importable) in which a product named ``FATAL`` ends the SQLite writer
thread with a BaseException, as nothing in toko raises: the stand-in for a bug.
"""

FATAL_PRODUCT = "FATAL"

FATAL_WRITER = f"""
import sys
from service import cli
from service.store.sqlite import products

class Fatal(BaseException):
    pass

real = products.create_products

def create_products(conn, items):
    if any(item[0] == {FATAL_PRODUCT!r} for item in items):
        raise Fatal()
    return real(conn, items)

products.create_products = create_products
sys.exit(cli.main())
"""
