"""`python -m mlxcel.engine.blas_shim`: build the BLAS shim now (scripts/setup.sh runs it)."""

from mlxcel.engine.blas_shim.build import main

raise SystemExit(main())
