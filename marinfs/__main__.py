from marinfs.app.cli import main

raise SystemExit(main())
