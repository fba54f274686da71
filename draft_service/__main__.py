from specdec.engine.openmp import limit_spinning

limit_spinning()  # before torch loads: it reads the setting once

from draft_service.server import main  # noqa: E402

main()
