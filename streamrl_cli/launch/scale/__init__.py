"""Scaling a running role's instances (generators): asked for, followed, carried out.

request   `streamrl scale`: post the wanted count to the run's rendezvous, wait for its outcome
follow    the process that watches the run applies the requests, in order, once each
executor  the count made so through the generators' launcher (launch.launcher): add or release
"""
