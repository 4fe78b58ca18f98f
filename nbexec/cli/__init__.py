"""The `nbexec` command line.

    main       the click group: run, serve, mcp and the options that mirror SandboxConfig
    commands   maintenance commands (doctor, cleanup), exit codes
    images     `nbexec image`: build the runtime image and named images, list them
    terminal   live output while a run works, colour only for people
    batch      many notebooks at once, a few at a time (CI)
    reports    JUnit XML, HTML renders and a summary of a batch
    render     results as text for people (pure)
    envfile    the `.env` file of the current folder, under the real environment

May import anything in nbexec; nothing imports the command line.
"""
