#!/bin/sh
# Test reward program: closes its stdout at once and keeps running.
exec >&-
sleep 30
