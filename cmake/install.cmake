# `cmake --install`: the libraries (as chorus::<module>), the public headers and the generated
# config.h, the `chorus` tool, and chorusConfig.cmake with its version file, so that
# find_package(chorus) works from the install prefix (tests/package checks both).
include(CMakePackageConfigHelpers)

get_property(chorus_libraries GLOBAL PROPERTY CHORUS_EXPORTED_LIBRARIES)
install(TARGETS ${chorus_libraries} EXPORT chorusTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS chorus RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/chorus DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/chorus/config.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/chorus)

set(chorus_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/chorus)
install(EXPORT chorusTargets NAMESPACE chorus:: DESTINATION ${chorus_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/chorusConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/chorusConfig.cmake INSTALL_DESTINATION ${chorus_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/chorusConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/chorusConfig.cmake ${PROJECT_BINARY_DIR}/chorusConfigVersion.cmake
        DESTINATION ${chorus_cmake_dir})
