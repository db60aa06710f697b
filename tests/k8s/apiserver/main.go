// pd-apiserver: the CRD-serving half of kube-apiserver (k8s.io/apiextensions-apiserver), standing alone for
// pd-operator's tests.
//
// The stock apiextensions-apiserver main delegates authentication, authorization and admission to a core API
// (TokenReviews, SubjectAccessReviews, Namespaces) that this server does not have. This main keeps every part
// that decides what a custom resource is — structural schemas, defaulting, pruning, CEL validation with its cost
// budget, the status subresource, watches, server-side apply — and replaces the parts that need a core API:
//
//   - one static bearer token (--token-file) authenticates as a member of system:masters; every request is
//     allowed;
//   - no admission plugins (so a namespace need not exist before objects are created in it);
//   - discovery: kube-apiserver's aggregator serves /apis for every group; here /apis lists apiextensions.k8s.io
//     and the groups of every established CRD, and /api lists no versions (there is no core API).
package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"

	"github.com/spf13/cobra"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apiserver"
	"k8s.io/apiextensions-apiserver/pkg/cmd/server/options"
	generatedopenapi "k8s.io/apiextensions-apiserver/pkg/generated/openapi"
	listers "k8s.io/apiextensions-apiserver/pkg/client/listers/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/version"
	"k8s.io/apiserver/pkg/authentication/authenticatorfactory"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/util/openapi"
	"k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/component-base/cli"
	netutils "k8s.io/utils/net"
)

func main() {
	ctx := genericapiserver.SetupSignalContext()
	o := options.NewCustomResourceDefinitionsServerOptions(os.Stdout, os.Stderr)
	// Nothing to delegate to: see the package comment.
	o.RecommendedOptions.Authentication = nil
	o.RecommendedOptions.Authorization = nil
	o.RecommendedOptions.CoreAPI = nil
	o.RecommendedOptions.Admission = nil
	// API priority and fairness keeps its configuration in objects of a core API.
	o.RecommendedOptions.Features.EnablePriorityAndFairness = false
	var tokenFile string

	cmd := &cobra.Command{
		Use:   "pd-apiserver",
		Short: "The CRD-serving half of kube-apiserver, without a core API",
		PersistentPreRunE: func(*cobra.Command, []string) error {
			return o.ServerRunOptions.ComponentGlobalsRegistry.Set()
		},
		RunE: func(c *cobra.Command, _ []string) error {
			token, err := os.ReadFile(tokenFile)
			if err != nil {
				return fmt.Errorf("--token-file: %w", err)
			}
			if err := o.Complete(); err != nil {
				return err
			}
			if err := o.Validate(); err != nil {
				return err
			}
			return run(c, o, strings.TrimSpace(string(token)))
		},
	}
	cmd.SetContext(ctx)
	o.AddFlags(cmd.Flags())
	cmd.Flags().StringVar(&tokenFile, "token-file", "", "file holding the one bearer token clients authenticate with")
	os.Exit(cli.Run(cmd))
}

func run(c *cobra.Command, o *options.CustomResourceDefinitionsServerOptions, token string) error {
	if token == "" {
		return fmt.Errorf("--token-file: the token is empty")
	}
	if err := o.RecommendedOptions.SecureServing.MaybeDefaultWithSelfSignedCerts(
		"localhost", nil, []net.IP{netutils.ParseIPSloppy("127.0.0.1")}); err != nil {
		return fmt.Errorf("self-signed certificates: %w", err)
	}
	serverConfig := genericapiserver.NewRecommendedConfig(apiserver.Codecs)
	if err := o.ServerRunOptions.ApplyTo(&serverConfig.Config); err != nil {
		return err
	}
	if err := o.RecommendedOptions.ApplyTo(serverConfig); err != nil {
		return err
	}
	// ApplyTo left no authenticator (none to delegate to): the one token, then the loopback client's own.
	serverConfig.Authentication.Authenticator = authenticatorfactory.NewFromTokens(map[string]*user.DefaultInfo{
		token: {Name: "pd-tests", UID: "pd-tests", Groups: []string{user.SystemPrivilegedGroup, user.AllAuthenticated}},
	}, nil)
	serverConfig.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()
	genericapiserver.AuthorizeClientBearerToken(serverConfig.LoopbackClientConfig, &serverConfig.Authentication, &serverConfig.Authorization)
	if err := o.APIEnablement.ApplyTo(&serverConfig.Config, apiserver.DefaultAPIResourceConfigSource(), apiserver.Scheme); err != nil {
		return err
	}
	// Both OpenAPI versions, as kube-apiserver serves them: the CRDs' own documents are published only where a
	// v2 document exists, and kubectl validates objects against them.
	definitions := openapi.GetOpenAPIDefinitionsWithoutDisabledFeatures(generatedopenapi.GetOpenAPIDefinitions)
	namer := openapinamer.NewDefinitionNamer(apiserver.Scheme, scheme.Scheme)
	serverConfig.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(definitions, namer)
	serverConfig.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(definitions, namer)
	config := &apiserver.Config{
		GenericConfig: serverConfig,
		ExtraConfig: apiserver.ExtraConfig{
			CRDRESTOptionsGetter: options.NewCRDRESTOptionsGetter(
				*o.RecommendedOptions.Etcd, serverConfig.ResourceTransformers, serverConfig.StorageObjectCountTracker),
			ServiceResolver:     noServices{},
			AuthResolverWrapper: webhook.NewDefaultAuthenticationInfoResolverWrapper(nil, nil, serverConfig.LoopbackClientConfig, nil),
		},
	}
	server, err := config.Complete().New(genericapiserver.NewEmptyDelegate())
	if err != nil {
		return err
	}
	crds := server.Informers.Apiextensions().V1().CustomResourceDefinitions().Lister()
	mux := server.GenericAPIServer.Handler.NonGoRestfulMux
	mux.Handle("/apis", groupList{crds})
	mux.Handle("/api", noCoreAPI{})
	return server.GenericAPIServer.PrepareRun().RunWithContext(c.Context())
}

// noServices resolves no Service: conversion webhooks cannot be reached without a core API.
type noServices struct{}

func (noServices) ResolveEndpoint(namespace, name string, _ int32) (*url.URL, error) {
	return nil, fmt.Errorf("no core API here to resolve service %s/%s", namespace, name)
}

// groupList answers /apis as kube-apiserver's aggregator would for this server: apiextensions.k8s.io and the
// group of every established CRD, each with its served versions, the preferred one first.
type groupList struct {
	crds listers.CustomResourceDefinitionLister
}

func (g groupList) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/apis" {
		http.NotFound(w, r)
		return
	}
	all, err := g.crds.List(labels.Everything())
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	versions := map[string]map[string]bool{apiextensionsv1.GroupName: {"v1": true}}
	for _, crd := range all {
		if !established(crd) {
			continue
		}
		for _, v := range crd.Spec.Versions {
			if v.Served {
				if versions[crd.Spec.Group] == nil {
					versions[crd.Spec.Group] = map[string]bool{}
				}
				versions[crd.Spec.Group][v.Name] = true
			}
		}
	}
	list := metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}, Groups: []metav1.APIGroup{}}
	for name, served := range versions {
		group := metav1.APIGroup{Name: name}
		for v := range served {
			group.Versions = append(group.Versions, metav1.GroupVersionForDiscovery{GroupVersion: name + "/" + v, Version: v})
		}
		sort.Slice(group.Versions, func(i, j int) bool {
			return version.CompareKubeAwareVersionStrings(group.Versions[i].Version, group.Versions[j].Version) > 0
		})
		group.PreferredVersion = group.Versions[0]
		list.Groups = append(list.Groups, group)
	}
	sort.Slice(list.Groups, func(i, j int) bool { return list.Groups[i].Name < list.Groups[j].Name })
	writeJSON(w, list)
}

func established(crd *apiextensionsv1.CustomResourceDefinition) bool {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextensionsv1.Established {
			return c.Status == apiextensionsv1.ConditionTrue
		}
	}
	return false
}

// noCoreAPI answers /api: this server has no core group, so no versions.
type noCoreAPI struct{}

func (noCoreAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/api" {
		http.NotFound(w, r)
		return
	}
	writeJSON(w, metav1.APIVersions{TypeMeta: metav1.TypeMeta{Kind: "APIVersions"}, Versions: []string{}})
}

func writeJSON(w http.ResponseWriter, body any) {
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(body); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
	}
}
